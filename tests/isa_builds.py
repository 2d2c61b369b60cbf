"""The CPU's instruction-set flags, and a C kernel built for a chosen ISA (``KVSERVE_CPU_ISA``), for tests that
check the AVX2 build of a kernel on an AVX-512 machine as well as the machine's own."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from kvserve import native


def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return set(next((line for line in lines if line.startswith("flags")), "").split())


def isa_build(source: Path, isa: str, *, batch_invariant: bool = True) -> ctypes.CDLL:
    """``source`` built for ``isa`` ("native": this machine's own), as ``native.load_library`` builds it with
    ``batch_invariant``; skips the test where this CPU lacks a flag that build needs (``native.ISA_CPU_FLAGS``)."""
    needs = set(native.ISA_CPU_FLAGS.get(isa, ()))
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU has no {' + '.join(sorted(needs - cpu_flags()))} to run the {isa} build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(native.ISA_ENV_VAR, isa)
        return ctypes.CDLL(str(native.library_path(source, batch_invariant=batch_invariant)))
