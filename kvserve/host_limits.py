"""What the host lets this process take where a container allows less than the machine has: memory (its cgroup's
limit) and CPU time (its cgroup's quota, which torch's thread count does not follow: torch counts the CPUs the
process may run on, and a pod limited to 2 CPUs of a 64-core node ran 64 threads, throttled in turn). Standard
library at import (the data-parallel router reads the quota too); torch only when threads are set."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

# the process's cgroups (`cgroup`) and where their hierarchies are mounted (`mountinfo`)
PROC_SELF = Path("/proc/self")
# how many local data-parallel replicas share this machine's memory (set by their parent), so each takes its share
SHARED_BY_ENV = "KVSERVE_LOCAL_REPLICAS"
logger = logging.getLogger(__name__)


def warn_if_cpus_are_busy() -> None:
    """A warning where other processes already keep this process's CPUs busy and OpenMP's threads (torch's and the
    kernels') spin between parallel regions as libgomp's default has them: each spinning thread then takes the
    engine thread's turns (steps 2-19x slower on a 2-core Zen 3 beside one busy process or a test run), which
    ``OMP_WAIT_POLICY=PASSIVE`` avoids at 0.8-0.9x on a quiet host (docs/results/session47-zen3/omp-spin.txt)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    load, cpus = os.getloadavg()[0], len(os.sched_getaffinity(0))
    if load > cpus:
        logger.warning("the load average (%.1f) is over this process's %d CPUs: OpenMP's spinning threads will take "
                       "turns from the steps; OMP_WAIT_POLICY=PASSIVE serves faster on a shared host", load, cpus)


def memory_limit() -> tuple[int | None, str]:
    """The most memory this process may take (bytes, or None where unknown) and what sets it: the machine's, or
    a cgroup's limit where lower (its own or an ancestor's); a local data-parallel replica's share of it."""
    limit, where = None, "this machine's memory"
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    # v1 writes a huge number (or -1) for none, v2 "max"
    for path in _cgroup_files("memory", v2="memory.max", v1="memory.limit_in_bytes"):
        text = _read(path)
        if text.isdigit() and (limit is None or int(text) < limit):
            limit, where = int(text), f"the memory limit of this container or service ({path})"
    sharers = os.environ.get(SHARED_BY_ENV, "")
    if limit is not None and sharers.isdigit() and int(sharers) > 1:
        limit, where = limit // int(sharers), f"a 1/{sharers} share of {where} (one of {sharers} local replicas)"
    return limit, where


def cpu_quota() -> float | None:
    """How many CPUs' worth of time the process's cgroups allow (the least of their quotas over their periods);
    None without one."""
    quotas = []
    for path in _cgroup_files("cpu", v2="cpu.max", v1="cpu.cfs_quota_us"):
        if path.name == "cpu.max":  # "QUOTA PERIOD", QUOTA "max" for none
            fields = _read(path).split()
        else:  # -1 for none
            fields = [_read(path), _read(path.with_name("cpu.cfs_period_us"))]
        try:
            quota, period = int(fields[0]), int(fields[1])
        except (ValueError, IndexError):  # "max", a file absent
            continue
        if quota > 0 and period > 0:
            quotas.append(quota / period)
    return min(quotas, default=None)


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


def _cgroup_files(controller: str, v2: str, v1: str) -> list[Path]:
    """The files named ``v2`` (cgroup v2) or ``v1`` (a v1 hierarchy with ``controller``) of the process's cgroup
    and of each of its ancestors up to the hierarchy's mount: an ancestor's limit binds its descendants too, and a
    service's limit (systemd's ``MemoryMax=``, ``CPUQuota=``) lies below the mount, not at it."""
    own = {}  # a hierarchy's controllers -> the process's cgroup in it ("" for v2)
    for line in _read(PROC_SELF / "cgroup").splitlines():
        fields = line.split(":", 2)  # "ID:CONTROLLERS:PATH"
        if len(fields) == 3:
            own[fields[1]] = fields[2]
    files, mounts_alone = [], []
    for mount_root, mount_point, fstype, options in _cgroup_mounts():
        if fstype == "cgroup2":
            path, name = own.get(""), v2
        elif controller in options.split(","):
            path, name = next((p for c, p in own.items() if controller in c.split(",")), None), v1
        else:
            continue
        if path is None:
            continue
        inside = os.path.relpath(path, mount_root)
        if inside == ".." or inside.startswith("../"):  # the mount shows another cgroup than the process's
            mounts_alone.append(mount_point / name)
            continue
        folder = mount_point / inside
        while folder != mount_point:
            files.append(folder / name)
            folder = folder.parent
        files.append(mount_point / name)
    # where no mount shows the process's cgroup (a container's view of its own), the mount's is the container's
    return files or mounts_alone


def _cgroup_mounts() -> list[tuple[str, Path, str, str]]:
    """Each cgroup hierarchy mounted: (the cgroup it shows, where it is mounted, "cgroup" or "cgroup2", its
    options)."""
    mounts = []
    for line in _read(PROC_SELF / "mountinfo").splitlines():
        fields, _, rest = line.partition(" - ")
        fields, rest = fields.split(), rest.split()
        if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            mounts.append((_unescape(fields[3]), Path(_unescape(fields[4])), rest[0], rest[2]))
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal escapes (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
