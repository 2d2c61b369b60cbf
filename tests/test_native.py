"""Building kvserve's C kernels: once, into the cache folder, on torch's OpenMP runtime; clear errors otherwise."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from kvserve import native
from kvserve.attention.cpu_paged import DECODE_SOURCE as KERNEL_SOURCE
from kvserve.model.layers.cpu_fused_ops import FUSED_OPS_SOURCE
from kvserve.native import KernelBuildError


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(native.platformdirs, "user_cache_dir", lambda app: str(tmp_path / app))
    return tmp_path / "kvserve" / "kernels"


@pytest.fixture
def answer_source(tmp_path: Path) -> Path:
    """A kernel that builds in a moment, for the cache's own behaviour (a real one takes 15-30 s on a slow CPU)."""
    source = tmp_path / "answer.c"
    source.write_text("int kvserve_answer(void) { return 42; }\n")
    return source


def test_kernel_is_built_once_into_the_cache_folder(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = native.library_path(KERNEL_SOURCE)
    assert path.parent == cache_dir and [p.name for p in cache_dir.iterdir()] == [path.name]
    assert path.name.startswith("paged_decode-")
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("compiled a second time"))
    assert native.library_path(KERNEL_SOURCE) == path
    assert callable(ctypes.CDLL(str(path)).kvserve_paged_decode_f32)


def test_batch_invariant_builds_keep_every_multiply_add_fused_and_are_cached_apart(cache_dir: Path) -> None:
    """gcc tuned for AMD Zen 1-3 left some multiply-adds unfused depending on the loop around them, so two inlined
    copies of one sum rounded apart (tests/attention/test_quantized_kv.py's batch-invariance tests failed on a Zen 3);
    kernels that need not be invariant (the GGUF block kernels) keep the CPU's tuning, in a library of their own."""
    assert "--param=avoid-fma-max-bits=0" in native.compile_flags()
    assert "--param=avoid-fma-max-bits=0" not in native.compile_flags(batch_invariant=False)
    invariant, tuned = (native.library_path(FUSED_OPS_SOURCE, batch_invariant=b) for b in (True, False))
    assert invariant != tuned and {p.name for p in cache_dir.iterdir()} == {invariant.name, tuned.name}


def test_kernel_shares_torchs_openmp_runtime() -> None:
    """The kernel's OpenMP calls bind to the libgomp torch loaded: a second runtime would bring a second
    thread pool that fights torch's for the cores."""
    def address(library: ctypes.CDLL) -> int:
        return ctypes.cast(library.omp_get_max_threads, ctypes.c_void_p).value

    kernel = native.load_library(KERNEL_SOURCE)
    assert address(kernel) == address(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libgomp.so.1")))


def test_a_change_to_any_included_header_rebuilds(cache_dir: Path, tmp_path: Path) -> None:
    """The build key covers what a source includes in quotes, also from another folder and through another
    header (the attention kernels include kv/csrc/int4_groups.h and csrc/vec_exp.h through kv_vectors.h)."""
    package = KERNEL_SOURCE.parents[2]
    kv_headers = package / "kv" / "csrc"
    assert native.included_headers(KERNEL_SOURCE) == [KERNEL_SOURCE.parent / "kv_vectors.h",
                                                      kv_headers / "encodings.h", kv_headers / "int4_groups.h",
                                                      package / "csrc" / "vec_exp.h"]
    assert native.included_headers(FUSED_OPS_SOURCE) == [package / "csrc" / "vec_exp.h"]
    (tmp_path / "src").mkdir()
    (tmp_path / "lib").mkdir()
    source = tmp_path / "src" / "kernel.c"
    source.write_text('#include "../lib/outer.h"\nint f(void) { return VALUE; }\n')
    (tmp_path / "lib" / "outer.h").write_text('#include "inner.h"\n')
    inner = tmp_path / "lib" / "inner.h"
    inner.write_text("#define VALUE 1\n")
    first = native.library_path(source)
    inner.write_text("#define VALUE 2\n")
    second = native.library_path(source)
    assert first != second and ctypes.CDLL(str(second)).f() == 2
    inner.unlink()
    with pytest.raises(KernelBuildError, match="could not read the kernel header .*inner.h: No such file"):
        native.library_path(source)


def test_missing_compiler_is_a_build_error(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(KernelBuildError, match="no C compiler"):
        native.library_path(KERNEL_SOURCE)


def test_compile_error_is_a_build_error_that_shows_gcc(cache_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("void f(void) { this is not C }\n")
    with pytest.raises(KernelBuildError, match="gcc failed to compile broken.c"):
        native.library_path(broken)
    assert not any(cache_dir.iterdir())  # no half-written library left behind


def test_a_failed_build_is_remembered_and_raised_again(cache_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken_once.c"
    broken.write_text("not C\n")
    for _ in range(2):
        with pytest.raises(KernelBuildError, match="gcc failed to compile broken_once.c"):
            native.load_library(broken)
    broken.write_text("int f(void) { return 1; }\n")  # not retried within the process
    with pytest.raises(KernelBuildError):
        native.load_library(broken)


def test_missing_source_is_a_build_error(tmp_path: Path) -> None:
    with pytest.raises(KernelBuildError, match="could not read the kernel source .*absent.c: No such file"):
        native.library_path(tmp_path / "absent.c")


def test_a_source_that_cannot_be_read_is_not_called_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of file descriptors (a burst of connections), the warning said the kernel's source was missing."""
    import errno

    def no_descriptor(self: Path) -> bytes:
        raise OSError(errno.EMFILE, "Too many open files", str(self))

    monkeypatch.setattr(Path, "read_bytes", no_descriptor)
    with pytest.raises(KernelBuildError, match=r"could not read the kernel source .*: Too many open files$"):
        native.library_path(KERNEL_SOURCE)


def test_a_cached_library_cut_short_is_built_again(cache_dir: Path, answer_source: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Loading a truncated library would fault (SIGBUS) once its missing pages were touched."""
    path = native.library_path(answer_source)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) * 3 // 10])
    assert native.library_path(answer_source) == path and path.read_bytes() == whole
    assert "cut short; building it again" in caplog.text
    assert ctypes.CDLL(str(path)).kvserve_answer() == 42


def test_a_cached_file_that_does_not_load_is_built_again(cache_dir: Path, answer_source: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = native.library_path(answer_source)
    path.write_bytes(b"\x7fELF\x02" + bytes(59))  # an ELF header naming no sections: whole, yet no library
    assert native.load_library(answer_source).kvserve_answer() == 42
    assert "does not load; building it again" in caplog.text


def test_builds_are_readable_by_all_and_a_killed_builds_leftover_goes(cache_dir: Path, answer_source: Path) -> None:
    cache_dir.mkdir(parents=True)
    leftover = cache_dir / f"{native.BUILD_PREFIX}abc.so"
    leftover.write_bytes(b"half")
    os.utime(leftover, (0, 0))
    path = native.library_path(answer_source)
    assert path.stat().st_mode & 0o777 == 0o755
    assert [p.name for p in cache_dir.iterdir()] == [path.name]


def test_a_new_build_removes_the_kernels_libraries_unused_for_two_weeks(cache_dir: Path, answer_source: Path) -> None:
    cache_dir.mkdir(parents=True)
    two_weeks = native.UNUSED_LIBRARY_S
    ages = {f"answer-{'0' * native.KEY_CHARS}.so": two_weeks + 60,  # removed
            f"answer-{'1' * native.KEY_CHARS}.so": two_weeks - 60,  # used lately: kept
            f"kv_store-{'0' * native.KEY_CHARS}.so": two_weeks + 60}  # another kernel's: kept
    for name, age in ages.items():
        (cache_dir / name).write_bytes(b"an old build")
        os.utime(cache_dir / name, (time.time() - age,) * 2)
    path = native.library_path(answer_source)
    assert sorted(p.name for p in cache_dir.iterdir()) == sorted([path.name, *list(ages)[1:]])


def test_using_a_cached_library_marks_it_used(cache_dir: Path, answer_source: Path) -> None:
    path = native.library_path(answer_source)
    os.utime(path, (0, 0))
    assert native.library_path(answer_source) == path
    assert time.time() - path.stat().st_mtime < 60


def test_a_kernel_that_cannot_be_built_is_none_with_a_warning_naming_what_runs_instead(
    caplog: pytest.LogCaptureFixture
) -> None:
    builds = []

    def unbuildable() -> object:
        builds.append(1)
        raise KernelBuildError("no C compiler: gcc is not on PATH")

    log = logging.getLogger("kvserve.test_native")
    missing = native.optional_kernel(unbuildable, "the twin runs", log)
    built = native.optional_kernel(lambda: [42], "the twin runs", log)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert missing() is None and missing() is None
        assert built() == [42] and built() is built()
    assert [r.getMessage() for r in caplog.records] == ["the twin runs: no C compiler: gcc is not on PATH"]
    assert len(builds) == 1  # built (or not) once a process


def test_an_unwritable_cache_folder_is_a_build_error_naming_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(native.platformdirs, "user_cache_dir", lambda app: str(blocked / app))
    with pytest.raises(KernelBuildError, match="into the kernel cache .*a-file/kvserve/kernels"):
        native.library_path(KERNEL_SOURCE)


@pytest.mark.parametrize("value", ["", " AVX2 ", "Native"])
def test_the_isa_variable_set_empty_or_in_capitals_is_read(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ISA_ENV_VAR, value)
    march = native.compile_flags()[-1]
    assert march == ("-march=haswell" if "avx2" in value.lower() else "-march=native")


def test_an_isa_this_cpu_lacks_is_refused_before_its_code_could_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without AVX-512 the avx512 build would stop the process at its first instruction (SIGILL)."""
    monkeypatch.setattr(native, "_cpuinfo_line", lambda prefixes: "flags : fpu sse2 avx avx2 fma f16c")
    monkeypatch.setenv(native.ISA_ENV_VAR, "avx512")
    with pytest.raises(KernelBuildError, match="needs avx512f, avx512bw, avx512dq, avx512vl, which this CPU lacks"):
        native.compile_flags()
    monkeypatch.setenv(native.ISA_ENV_VAR, "avx2")
    assert native.compile_flags()[-1] == "-march=haswell"
