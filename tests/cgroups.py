"""A process's cgroups faked in a folder, as kvserve's host_limits reads them: ``/proc/self/cgroup``,
``/proc/self/mountinfo`` and the hierarchies' files, where a test writes the limits it needs at the process's
cgroup or an ancestor's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve import host_limits

# v1's hierarchies as distributions mount them: memory alone, cpu with cpuacct
V1_HIERARCHIES = {"memory": "4:memory", "cpu,cpuacct": "2:cpu,cpuacct"}


def fake_cgroups(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, own: str = "/", version: int = 2,
                 mount_root: str = "/") -> Callable[..., Path]:
    """The process in cgroup ``own`` of cgroup ``version``'s hierarchies, each mounted showing ``mount_root`` (a
    container's view) under a folder whose name has a space (which mountinfo escapes). Returns
    ``write(name, text, at=own) -> Path``, which writes a cgroup's file."""
    proc, mounts = tmp_path / "proc", tmp_path / "sys fs"
    proc.mkdir(exist_ok=True)
    if version == 2:
        (proc / "cgroup").write_text(f"0::{own}\n")
        hierarchies = {"": mounts}
        mountinfo = f"41 31 0:38 {mount_root} {_escaped(mounts)} rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
    else:
        (proc / "cgroup").write_text("".join(f"{line}:{own}\n" for line in V1_HIERARCHIES.values()) + "0::/\n")
        hierarchies = {name: mounts / name for name in V1_HIERARCHIES}
        mountinfo = "".join(f"3{i} 31 0:3{i} {mount_root} {_escaped(folder)} rw,relatime - cgroup cgroup rw,{name}\n"
                            for i, (name, folder) in enumerate(hierarchies.items()))
    (proc / "mountinfo").write_text("25 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n" + mountinfo)
    monkeypatch.setattr(host_limits, "PROC_SELF", proc)

    def write(name: str, text: str, at: str = own) -> Path:
        hierarchy = hierarchies[""] if version == 2 else hierarchies["memory" if name.startswith("memory") else
                                                                      "cpu,cpuacct"]
        path = hierarchy / Path(at).relative_to(mount_root) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return write


def _escaped(path: Path) -> str:
    return str(path).replace(" ", "\\040")
