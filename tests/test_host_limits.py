"""A container's CPU quota read from its cgroup (v2's cpu.max, v1's cfs files), and a server's threads fitted to it;
its memory limit is tested with the KV budget that uses it (tests/engine/test_kv_budget.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from kvserve import host_limits

from tests.cgroups import fake_cgroups


def cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v2: str | None = None,
           v1: tuple[str, str] | None = None) -> None:
    """The CPU quota files of the process's own cgroup, of version 2 unless ``v1``'s are given."""
    write = fake_cgroups(monkeypatch, tmp_path, version=1 if v1 else 2)
    if v2 is not None:
        write("cpu.max", v2)
    if v1 is not None:
        write("cpu.cfs_quota_us", v1[0])
        write("cpu.cfs_period_us", v1[1])


@pytest.mark.parametrize("v2, v1, quota", [
    ("150000 100000\n", None, 1.5), ("max 100000\n", None, None), (None, ("50000", "100000"), 0.5),
    (None, ("-1", "100000"), None), (None, None, None), ("garbage", None, None),
])
def test_the_cpu_quota_is_read_from_either_cgroup_version(monkeypatch, tmp_path: Path, v2, v1, quota) -> None:
    cgroup(monkeypatch, tmp_path, v2, v1)
    assert host_limits.cpu_quota() == quota


@pytest.mark.parametrize("version", [1, 2])
def test_a_limit_of_the_processs_cgroup_or_an_ancestors_binds(monkeypatch, tmp_path: Path, version: int) -> None:
    """A systemd service's `CPUQuota=` / `MemoryMax=` are its own cgroup's, below the hierarchy's mount: read at
    the mount alone, the service's limits were missed. An ancestor's limit binds its descendants: the least."""
    write = fake_cgroups(monkeypatch, tmp_path, own="/system.slice/kvserve.service", version=version)
    if version == 2:
        write("cpu.max", "300000 100000", at="/system.slice")
        write("cpu.max", "max 100000")
        write("memory.max", "max", at="/system.slice")
        limit = write("memory.max", f"{2**30}\n")
    else:
        write("cpu.cfs_quota_us", "150000", at="/system.slice")
        write("cpu.cfs_period_us", "100000", at="/system.slice")
        write("cpu.cfs_quota_us", "-1")
        write("memory.limit_in_bytes", f"{2**31}", at="/system.slice")
        limit = write("memory.limit_in_bytes", f"{2**30}")
    assert host_limits.cpu_quota() == (3.0 if version == 2 else 1.5)
    assert host_limits.memory_limit() == (2**30, f"the memory limit of this container or service ({limit})")


@pytest.mark.parametrize("own, mount_root", [("/docker/c0ffee", "/docker/c0ffee"), ("/kubepods/pod1", "/other")])
def test_a_containers_mount_shows_its_own_cgroup_at_the_mount(monkeypatch, tmp_path: Path, own: str,
                                                               mount_root: str) -> None:
    """Without a cgroup namespace, /proc/self/cgroup names the container's cgroup as the host sees it while the
    container's mount shows only that cgroup (or, where no mount shows the process's, another): the mount's."""
    write = fake_cgroups(monkeypatch, tmp_path, own=own, mount_root=mount_root)
    write("cpu.max", "200000 100000", at=mount_root)
    assert host_limits.cpu_quota() == 2.0


def test_a_second_mount_of_another_cgroup_is_not_read_where_one_shows_the_processs(monkeypatch,
                                                                                     tmp_path: Path) -> None:
    """A mount of another service's cgroup (its own limits) beside the hierarchy's: the process took them."""
    write = fake_cgroups(monkeypatch, tmp_path, own="/user.slice/a")
    write("memory.max", "max")
    other = tmp_path / "db"
    (other / "memory.max").parent.mkdir()
    (other / "memory.max").write_text(f"{2**30}")
    (other / "cpu.max").write_text("50000 100000")
    mountinfo = host_limits.PROC_SELF / "mountinfo"
    mount = f"42 31 0:38 /system.slice/db.service {other} rw - cgroup2 cgroup2 rw\n"
    mountinfo.write_text(mountinfo.read_text() + mount)
    assert host_limits.cpu_quota() is None
    assert host_limits.memory_limit()[1] == "this machine's memory"


def test_without_cgroups_there_are_no_limits_but_the_machines(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(host_limits, "PROC_SELF", tmp_path / "absent")  # not Linux
    assert host_limits.cpu_quota() is None
    assert host_limits.memory_limit()[1] == "this machine's memory"


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


@pytest.mark.parametrize("cpu_max, omp, processes, threads", [
    ("150000 100000", None, 1, 1),  # whole CPUs only: a second thread would be throttled half the time
    ("400000 100000", "", 2, 2),  # an empty OMP_NUM_THREADS chooses nothing (libgomp ignores it too)
    ("400000 100000", "3", 1, None), ("50000 100000", None, 4, 1), ("max 100000", None, 1, None),
])
def test_each_process_gets_its_share_of_the_quotas_whole_cpus(monkeypatch, tmp_path: Path, cpu_max: str,
                                                              omp: str | None, processes: int, threads) -> None:
    cgroup(monkeypatch, tmp_path, v2=cpu_max)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert host_limits.quota_threads(processes) == threads


def test_replicas_on_this_machine_share_its_quota_and_memory(monkeypatch, tmp_path: Path) -> None:
    """Each local replica of `serve --data-parallel-size N` fitted itself to the whole quota: N times it."""
    import argparse

    from kvserve.router.launch import add_data_parallel_arguments, replica_command

    cgroup(monkeypatch, tmp_path, v2="400000 100000")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key", nargs="+", default=None)
    add_data_parallel_arguments(parser)
    argv = ["serve", "m", "--data-parallel-size", "2"]
    assert replica_command(parser.parse_known_args(argv)[0], argv)[1] == {"OMP_NUM_THREADS": "2",
                                                                          "KVSERVE_LOCAL_REPLICAS": "2"}
    argv = [*argv, "--data-parallel-backend", "ray"]  # Ray's local cluster: this machine's memory, Ray's threads
    assert replica_command(parser.parse_known_args(argv)[0], argv)[1] == {"KVSERVE_LOCAL_REPLICAS": "2"}
    argv = [*argv, "--ray-address", "head:6379"]  # actors on other machines, under their own limits
    assert replica_command(parser.parse_known_args(argv)[0], argv)[1] == {}


@pytest.mark.parametrize("environment, load, warned", [
    ({}, 5.0, True), ({}, 0.5, False), ({"OMP_WAIT_POLICY": "PASSIVE"}, 5.0, False),
    ({"GOMP_SPINCOUNT": "0"}, 5.0, False),
])
def test_a_server_started_on_busy_cpus_is_told_how_to_keep_its_threads_from_spinning(
        monkeypatch, caplog: pytest.LogCaptureFixture, environment: dict, load: float, warned: bool) -> None:
    """With libgomp's spin, another busy process made steps 2-19x slower on 2 cores (PASSIVE: 2x faster there)."""
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level(logging.WARNING, logger="kvserve.host_limits"):
        host_limits.warn_if_cpus_are_busy()
    assert any("OMP_WAIT_POLICY=PASSIVE" in r.getMessage() for r in caplog.records) == warned
