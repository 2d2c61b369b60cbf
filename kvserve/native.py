"""kvserve's C kernels: compiled with the system's gcc at first use, cached, and called through ctypes.

A kernel is one C file with no torch headers, so it builds in about a second. The library goes into the user's
cache folder under a name keyed by a hash of the source, the flags and the CPU (``-march=native`` code built on
one CPU may not run on another sharing the folder). Where torch ships GNU OpenMP (the Linux wheels) the library
binds to torch's ``libgomp.so.1``, already loaded, so the kernels and torch's ops share one thread pool rather
than fighting for the cores. A library no process has used for two weeks is removed when its kernel is built anew.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import platformdirs
import torch

T = TypeVar("T")
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_log = logging.getLogger(__name__)
COMPILE_FLAGS = ("-O3", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
# For kernels whose sums must not depend on the batch: gcc tuned for AMD Zen 1-3 (-march=native there) leaves a
# multiply and an add unfused where they form a chain in a loop, and that call depends on the loop around them, so
# two inlined copies of one sum (a decode alone and the same decode in a sharing group; a prompt cut into other
# chunks) rounded differently, and a request's output bits depended on its batch on those CPUs alone. Always
# fused, as on every other CPU. (The GGUF block kernels, batch-dependent by design, keep the CPU's own tuning.)
BATCH_INVARIANT_FLAGS = ("--param=avoid-fma-max-bits=0",)
# The one environment variable kvserve's kernels read: KVSERVE_CPU_ISA=avx2 builds them for AVX2 + FMA
# (Haswell) on any x86-64 CPU, so that a developer on an AVX-512 machine can measure the AVX2 code paths too
# (ATEN_CPU_CAPABILITY=avx2 does the same for torch's own kernels); avx512 builds for Skylake-X's AVX-512, so
# that tests name the AVX-512 paths whatever the machine's newer extensions; avx512vnni (Cascade Lake) and
# avxvnni (Alder Lake: AVX2 with VNNI) name the int8 dot products' VNNI paths. Default: the machine's own ISA.
ISA_ENV_VAR = "KVSERVE_CPU_ISA"
ISA_MARCH = {"native": "-march=native", "avx2": "-march=haswell", "avx512": "-march=skylake-avx512",
             "avx512vnni": "-march=cascadelake", "avxvnni": "-march=alderlake"}
# what each ISA's code needs of the CPU, as /proc/cpuinfo names it (the extensions its vector code uses)
ISA_CPU_FLAGS = {"avx2": ("avx2", "fma", "f16c"),
                 "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"),
                 "avx512vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"),
                 "avxvnni": ("avx2", "fma", "f16c", "avx_vnni")}
COMPILE_TIMEOUT_S = 120
BUILD_PREFIX = ".build-"  # a library being built; one a killed build left is removed after STALE_BUILD_S
STALE_BUILD_S = 3600
# A library of an older source, other flags or another CPU that no process has loaded for this long is removed
# when its kernel is built anew: without it, every edit of a kernel left its library in the cache for good.
UNUSED_LIBRARY_S = 14 * 24 * 3600
KEY_CHARS = 16  # of the hash in a library's name


def kernel_range(name: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler`` range named ``name`` around a kernel call (a ctypes call is no op the profiler sees),
    entered only while a profiler records: a range costs ~5 us, and a step calls the kernels a hundred times."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class KernelFunction:
    """A C function of a kernel library, called with raw pointers and numbers. While a ``recording`` is open on
    the calling thread, each call is also handed to it: a CPU step graph (``kvserve/worker/cpu_graph.py``)
    replays the step's calls later without the Python that made them."""

    def __init__(self, function: ctypes._CFuncPtr, arg_types: list, result_type: Any = None) -> None:
        function.argtypes = arg_types
        function.restype = result_type
        self.function = function
        self.name = function.__name__

    def __call__(self, *args: Any) -> Any:
        result = self.function(*args)
        if _num_recordings:  # a thread-local lookup only while some thread records
            record = getattr(_recordings, "record", None)
            if record is not None:
                record(self, args)
        return result

    def converted(self, args: tuple) -> tuple:
        """``args`` as the C types the function takes (None stays a null pointer): a call with them skips
        ctypes' conversion of each Python number, ~40% of a call's cost."""
        return tuple(a if a is None else arg_type(a) for arg_type, a in zip(self.function.argtypes, args))


_recordings = threading.local()  # ``record``: the recording open in this thread, if any
_num_recordings = 0  # open in any thread
_recordings_lock = threading.Lock()


@contextlib.contextmanager
def recording(record: Callable[[KernelFunction, tuple], None]) -> Iterator[None]:
    """Hand every ``KernelFunction`` call this thread makes to ``record`` (the function and its arguments),
    after the call has run. One recording at a time in a thread; threads record apart (two engines of one
    process may each record a step graph at once)."""
    global _num_recordings
    if getattr(_recordings, "record", None) is not None:
        raise RuntimeError("a kernel recording is already open in this thread")
    _recordings.record = record
    with _recordings_lock:
        _num_recordings += 1
    try:
        yield
    finally:
        _recordings.record = None
        with _recordings_lock:
            _num_recordings -= 1


class KernelBuildError(RuntimeError):
    """A kernel could not be compiled or loaded (no compiler, a compile error, an unloadable library)."""


def optional_kernel(build: Callable[[], T], fallback: str, log: logging.Logger) -> Callable[[], T | None]:
    """A function giving this process's ``build()``, built at its first call and the same object after
    (``functools.cache``: ``cache_clear()`` forgets it), or None where its kernel cannot be built, with one
    warning on ``log`` that says what runs instead (``fallback``) and why: each kernel has a slower twin."""

    @functools.cache
    def kernel() -> T | None:
        try:
            return build()
        except KernelBuildError as error:
            log.warning("%s: %s", fallback, error)
            return None

    return kernel


def load_library(source: Path, *, batch_invariant: bool = True) -> ctypes.CDLL:
    """The compiled library of ``source``, built at most once per process; raises ``KernelBuildError`` (every
    time, without retrying: a retry would fail the same way). ``batch_invariant``: built so that a sum's rounding
    never depends on the code around it (``BATCH_INVARIANT_FLAGS``)."""
    library = _load_once(source, batch_invariant)
    if isinstance(library, KernelBuildError):
        raise KernelBuildError(str(library))
    return library


@functools.cache
def _load_once(source: Path, batch_invariant: bool) -> ctypes.CDLL | KernelBuildError:
    try:
        path = library_path(source, batch_invariant=batch_invariant)
        try:
            return ctypes.CDLL(str(path))
        except OSError:  # a cached file that is not a library (a copy cut short, a disk fault): built again once
            _log.warning("the cached kernel library %s does not load; building it again", path)
            _compile(source, path, compile_flags(batch_invariant=batch_invariant))
        try:
            return ctypes.CDLL(str(path))
        except OSError as error:
            raise KernelBuildError(f"could not load the kernel library {path}: {error}") from error
    except KernelBuildError as error:
        return error


def library_path(source: Path, *, batch_invariant: bool = True) -> Path:
    """Where the library of ``source`` is cached, compiling it first if it is not there yet."""
    try:
        text = source.read_bytes()
    except OSError as error:
        # its reason said: out of descriptors or memory, the source is there
        raise KernelBuildError(f"could not read the kernel source {source}: {error.strerror or error}") from error
    flags = compile_flags(batch_invariant=batch_invariant)
    headers = [header.read_bytes() for header in included_headers(source)]
    key = hashlib.sha256(b"\0".join([text, *headers, " ".join(flags).encode(), _cpu_id().encode()])).hexdigest()
    path = Path(platformdirs.user_cache_dir("kvserve")) / "kernels" / f"{source.stem}-{key[:KEY_CHARS]}.so"
    if not path.exists():
        _compile(source, path, flags)
        _remove_unused_libraries(path.parent, source.stem)
    elif not _is_whole_elf(path):  # loading a truncated library faults (SIGBUS) when the missing pages are touched
        _log.warning("the cached kernel library %s is cut short; building it again", path)
        _compile(source, path, flags)
    else:
        with contextlib.suppress(OSError):  # its modification time says when it was last used (see below)
            os.utime(path)
    return path


def _is_whole_elf(path: Path) -> bool:
    """Whether ``path`` holds a 64-bit ELF file as long as its header says: its section header table, which the
    linker writes last, ends within the file."""
    try:
        with path.open("rb") as file:
            header = file.read(64)
            size = os.fstat(file.fileno()).st_size
    except OSError:
        return False
    if len(header) < 64 or header[:5] != b"\x7fELF\x02":
        return False
    order = "little" if header[5] == 1 else "big"
    table_offset = int.from_bytes(header[40:48], order)
    entry_size, num_entries = int.from_bytes(header[58:60], order), int.from_bytes(header[60:62], order)
    return table_offset + entry_size * num_entries <= size


def included_headers(source: Path) -> list[Path]:
    """Every file that ``source`` includes in quotes (``#include "x.h"``, relative to the including file), and
    those files' own, in the order first met: what a change of must rebuild the library."""
    found: list[Path] = []
    pending = [source]
    while pending:
        including = pending.pop(0)
        try:
            text = including.read_text()
        except OSError as error:
            raise KernelBuildError(f"could not read the kernel header {including}: {error.strerror or error}") \
                from error
        for name in _QUOTED_INCLUDE.findall(text):
            header = (including.parent / name).resolve()
            if header not in found:
                found.append(header)
                pending.append(header)
    return found


def compile_flags(*, batch_invariant: bool = True) -> tuple[str, ...]:
    """gcc's flags for the kernels, for the ISA that ``$KVSERVE_CPU_ISA`` names (default, or set empty: this CPU's
    own); an ISA this CPU lacks is refused, as its code would stop the process at its first instruction."""
    value = os.environ.get(ISA_ENV_VAR, "")
    isa = value.strip().lower() or "native"
    if isa not in ISA_MARCH:
        raise KernelBuildError(f"{ISA_ENV_VAR}={value!r} is not a kernel ISA; expected one of {', '.join(ISA_MARCH)}")
    flags = _cpuinfo_line(("flags", "Features"))
    missing = [flag for flag in ISA_CPU_FLAGS.get(isa, ()) if flags is not None and flag not in flags.split()]
    if missing:
        raise KernelBuildError(f"{ISA_ENV_VAR}={value!r} needs {', '.join(missing)}, which this CPU lacks")
    return (*COMPILE_FLAGS, *(BATCH_INVARIANT_FLAGS if batch_invariant else ()), ISA_MARCH[isa])


def _cpuinfo_line(prefixes: tuple[str, ...]) -> str | None:
    """/proc/cpuinfo's first line starting with one of ``prefixes`` ("" if none), or None where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line for line in lines if line.startswith(prefixes)), "")


def cpu_vendor() -> str:
    """The CPU's maker as /proc/cpuinfo names it (``GenuineIntel``, ``AuthenticAMD``), or "" where it does not."""
    return (_cpuinfo_line(("vendor_id",)) or "").partition(":")[2].strip()


def cpu_family() -> int:
    """The CPU's family number as /proc/cpuinfo gives it (AMD Zen 4: 25, Zen 5: 26), or 0 where it does not."""
    value = (_cpuinfo_line(("cpu family",)) or "").partition(":")[2].strip()
    return int(value) if value.isdigit() else 0


def _cpu_id() -> str:
    """What ``-march=native`` depends on."""
    flags = _cpuinfo_line(("flags", "Features"))
    return platform.machine() + (platform.processor() if flags is None else flags)


def _compile(source: Path, path: Path, flags: tuple[str, ...]) -> None:
    compiler = shutil.which("gcc")
    if compiler is None:
        raise KernelBuildError("no C compiler: gcc is not on PATH")
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_builds(path.parent)
        # build beside the target and rename, so concurrent processes never load a half-written library
        fd, tmp = tempfile.mkstemp(prefix=BUILD_PREFIX, suffix=".so", dir=path.parent)
        os.close(fd)
        result = subprocess.run(
            [compiler, *flags, str(source), "-o", tmp, "-lm"],
            capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise KernelBuildError(f"gcc failed to compile {source.name}:\n{result.stderr.strip()}")
        with open(tmp, "rb") as built:  # on the disk before its name is: a crash never leaves a short library
            os.fsync(built.fileno())
        os.chmod(tmp, 0o755)  # readable by whoever shares the cache folder (mkstemp's file is the owner's alone)
        os.replace(tmp, path)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise KernelBuildError(f"could not build {source.name} into the kernel cache {path.parent}: {error}") from error
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _remove_unused_libraries(folder: Path, stem: str) -> None:
    """Remove the libraries of kernel ``stem`` that no process has used for ``UNUSED_LIBRARY_S`` (each use sets a
    library's modification time). A process that still has one loaded keeps its mapping; a later use builds it
    again."""
    now = time.time()
    for library in folder.glob(f"{stem}-{'?' * KEY_CHARS}.so"):
        with contextlib.suppress(OSError):
            if now - library.stat().st_mtime > UNUSED_LIBRARY_S:
                library.unlink()


def _remove_stale_builds(folder: Path) -> None:
    """Remove the partial libraries that builds killed midway left behind."""
    now = time.time()
    for leftover in folder.glob(f"{BUILD_PREFIX}*.so"):
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > STALE_BUILD_S:
                leftover.unlink()
