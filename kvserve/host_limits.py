"""What the host lets this process take where a container allows less than the machine has: memory (its cgroup's
limit) and CPU time (its cgroup's quota, which torch's thread count does not follow: torch counts the CPUs the
process may run on, and a pod limited to 2 CPUs of a 64-core node ran 64 threads, throttled in turn). Standard
library at import (the data-parallel router reads the quota too); torch only when threads are set."""

from __future__ import annotations

import logging
import os
from pathlib import Path

# where a container's limits are read: cgroup v2's file, then v1's (v1 writes a huge number, or -1, for none)
CGROUP_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # "QUOTA PERIOD", QUOTA "max" for none
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")  # cpu.cfs_quota_us (-1 for none) and cpu.cfs_period_us
logger = logging.getLogger(__name__)


def memory_limit() -> tuple[int | None, str]:
    """The most memory this process may take (bytes, or None where unknown) and what sets it: the machine's, or
    its container's (a cgroup's limit) where lower."""
    limit, where = None, "this machine's memory"
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    for path in CGROUP_MEMORY_LIMITS:
        text = _read(path)
        if text.isdigit() and (limit is None or int(text) < limit):
            limit, where = int(text), f"this container's memory limit ({path})"
    return limit, where


def cpu_quota() -> float | None:
    """How many CPUs' worth of time the container's cgroup allows (its quota over its period); None without one."""
    fields = _read(CGROUP_V2_CPU_MAX).split()
    if len(fields) != 2:
        fields = [_read(CGROUP_V1_CPU / "cpu.cfs_quota_us"), _read(CGROUP_V1_CPU / "cpu.cfs_period_us")]
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:  # "max", a file absent
        return None
    return quota / period if quota > 0 and period > 0 else None


def quota_threads(num_processes: int = 1) -> int | None:
    """How many CPU threads each of ``num_processes`` sharing the container gets: its CPU quota's whole CPUs, at
    least one (threads past the quota wait their turn, and a step waits on its slowest thread); None where there
    is no quota, or ``$OMP_NUM_THREADS`` chose a number."""
    quota = cpu_quota()
    if quota is None or os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return None
    return max(1, int(quota / num_processes))


def fit_threads_to_cpu_quota() -> None:
    """Run ``quota_threads()`` CPU threads where that is below torch's count."""
    import torch

    threads, quota = quota_threads(), cpu_quota()
    if threads is not None and threads < torch.get_num_threads():
        logger.info("a CPU quota of %.2f CPUs (cgroup): %d threads, not %d (OMP_NUM_THREADS sets another number)",
                    quota, threads, torch.get_num_threads())
        torch.set_num_threads(threads)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
