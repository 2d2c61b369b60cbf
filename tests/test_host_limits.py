"""A container's CPU quota read from its cgroup (v2's cpu.max, v1's cfs files), and a server's threads fitted to it;
its memory limit is tested with the KV budget that uses it (tests/engine/test_kv_budget.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import host_limits


def cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v2: str | None = None, v1: tuple[str, str] | None = None):
    monkeypatch.setattr(host_limits, "CGROUP_V2_CPU_MAX", tmp_path / "cpu.max")
    monkeypatch.setattr(host_limits, "CGROUP_V1_CPU", tmp_path / "cpu")
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(v1[0])
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(v1[1])


@pytest.mark.parametrize("v2, v1, quota", [
    ("150000 100000\n", None, 1.5), ("max 100000\n", None, None), (None, ("50000", "100000"), 0.5),
    (None, ("-1", "100000"), None), (None, None, None), ("garbage", None, None),
])
def test_the_cpu_quota_is_read_from_either_cgroup_version(monkeypatch, tmp_path: Path, v2, v1, quota) -> None:
    cgroup(monkeypatch, tmp_path, v2, v1)
    assert host_limits.cpu_quota() == quota


def test_a_server_runs_as_many_threads_as_its_quota_unless_omp_num_threads_chose(monkeypatch, tmp_path: Path) -> None:
    """A pod limited to 2 CPUs of a 64-core node ran 64 threads, throttled in turn (a 1-CPU cgroup of this
    2-core machine: a bench 2-15x slower with 2 threads than with 1)."""
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        cgroup(monkeypatch, tmp_path, v2="50000 100000")
        host_limits.fit_threads_to_cpu_quota()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        host_limits.fit_threads_to_cpu_quota()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
