"""benchmarks/avx2_only.sh: a command run through it sees a CPU without AVX-512, and keeps its own fault handling.

These run where the mask can work: an x86-64 Linux CPU with AVX-512 and CPUID faulting (the "cpuid_fault" flag)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "avx2_only.sh"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


pytestmark = pytest.mark.skipif(
    not {"avx512f", "cpuid_fault"} <= _cpu_flags() or shutil.which("gcc") is None,
    reason="needs an AVX-512 CPU with CPUID faulting, and gcc")

# leaf 7's AVX2 and AVX512F bits as the CPUID instruction answers, and as gcc's builtin (which caches CPUID) sees them;
# then, with a SIGSEGV handler of the program's own installed, CPUID again and a real fault, which reaches that handler
PROBE = r"""
#include <cpuid.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static void on_segv(int sig) { (void)sig; write(1, "own handler\n", 12); _exit(3); }
static void show_leaf_7(void) {
    unsigned a, b, c, d;
    __cpuid_count(7, 0, a, b, c, d);
    printf("avx2=%u avx512f=%u\n", (b >> 5) & 1, (b >> 16) & 1);
    fflush(stdout);
}
int main(int argc, char **argv) {
    show_leaf_7();
    __builtin_cpu_init();
    printf("builtin avx512f=%d\n", __builtin_cpu_supports("avx512f") != 0);
    if (argc > 1) {  /* CPUID still answered once the program has its own handler, which real faults reach */
        signal(SIGSEGV, on_segv);
        show_leaf_7();
        *(volatile int *)(argc - 2) = 1;
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("avx2_only")
    (folder / "probe.c").write_text(PROBE)
    subprocess.run(["gcc", "-O1", "-o", str(folder / "probe"), str(folder / "probe.c")], check=True)
    return folder / "probe"


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *command], capture_output=True, text=True, timeout=120)


def test_cpuid_shows_avx2_without_avx512(probe: Path) -> None:
    assert subprocess.run([str(probe)], capture_output=True, text=True).stdout.splitlines() == [
        "avx2=1 avx512f=1", "builtin avx512f=1"]
    masked = _run(str(probe))
    assert masked.returncode == 0, masked.stderr
    assert masked.stdout.splitlines() == ["avx2=1 avx512f=0", "builtin avx512f=0"]


def test_cpuid_answered_and_real_faults_handled_under_the_programs_own_handler(probe: Path) -> None:
    masked = _run(str(probe), "fault")
    assert masked.returncode == 3, masked.stderr
    assert masked.stdout.splitlines() == ["avx2=1 avx512f=0", "builtin avx512f=0", "avx2=1 avx512f=0", "own handler"]


def test_a_fault_without_a_handler_still_kills_the_program(tmp_path: Path) -> None:
    source = tmp_path / "crash.c"
    source.write_text("int main(int argc, char **argv) { *(volatile int *)(argc - 1) = 1; return 0; }\n")
    subprocess.run(["gcc", "-O1", "-o", str(tmp_path / "crash"), str(source)], check=True)
    assert _run(str(tmp_path / "crash")).returncode == -11  # SIGSEGV, as without the mask


def test_torch_picks_its_avx2_kernels_by_cpuid_alone() -> None:
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    # ATEN_CPU_CAPABILITY emptied: torch's choice comes from CPUID, through the mask
    masked = _run("env", "ATEN_CPU_CAPABILITY=", sys.executable, "-c", code)
    assert masked.returncode == 0, masked.stderr
    assert masked.stdout.strip() == "AVX2"
