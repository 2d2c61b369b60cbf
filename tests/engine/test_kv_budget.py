"""The KV pool's size: a CPU pool (or a host tier) larger than the memory the process may take is refused at
start, naming the flag, since its pages are taken only as its blocks fill."""

from __future__ import annotations

import errno
import mmap
from pathlib import Path

import pytest
import torch

from kvserve import LLM
from kvserve.config import CacheConfig
from kvserve import host_limits
from kvserve.engine.kv_budget import num_kv_blocks_for
from kvserve.kv.storage import zeros


def container_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> Path:
    limit = tmp_path / "memory.max"
    limit.write_text(text)
    monkeypatch.setattr(host_limits, "CGROUP_MEMORY_LIMITS", (tmp_path / "absent", limit))
    return limit


@pytest.mark.parametrize("cache, flag", [(CacheConfig(kv_cache_memory=2.0), "--kv-cache-memory"),
                                         (CacheConfig(num_kv_blocks=2**16), "--num-kv-blocks")])
def test_a_cpu_pool_larger_than_the_containers_memory_is_refused_naming_its_flag(
        monkeypatch, tmp_path: Path, cache: CacheConfig, flag: str) -> None:
    """A 64 GiB pool started on a 23 GiB machine: its pages, mapped untouched, would have been taken as the
    prefix cache filled, and the process killed for memory hours later."""
    limit = container_limit(monkeypatch, tmp_path, f"{2**30}\n")
    with pytest.raises(ValueError, match=rf"the KV cache \(2\.0 GiB\) is larger than this container's memory limit "
                                         rf"\({limit}\) \(1\.0 GiB\): .*; lower {flag}"):
        num_kv_blocks_for(cache, 2**15, torch.device("cpu"), None)
    assert num_kv_blocks_for(CacheConfig(kv_cache_memory=0.5), 2**15, torch.device("cpu"), None) == 2**14


def test_no_container_limit_leaves_the_machines_memory(monkeypatch, tmp_path: Path) -> None:
    container_limit(monkeypatch, tmp_path, "max\n")  # cgroup v2's "no limit" (v1 writes a huge number)
    limit, where = host_limits.memory_limit()
    assert where == "this machine's memory" and limit is not None and limit > 2**28
    with pytest.raises(ValueError, match=r"is larger than this machine's memory"):
        num_kv_blocks_for(CacheConfig(kv_cache_memory=limit / 2**30 + 1), 2**20, torch.device("cpu"), None)


def test_a_host_tier_larger_than_the_memory_is_refused(monkeypatch, tmp_path: Path, tiny_checkpoints) -> None:
    container_limit(monkeypatch, tmp_path, f"{2**31}")
    with pytest.raises(ValueError, match="lower --kv-offload-memory"):
        LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, kv_offload_memory=4.0)


def test_a_pool_the_address_space_cannot_map_is_named(monkeypatch) -> None:
    """Under `ulimit -v` the error was "[Errno 12] Cannot allocate memory", naming neither the pool nor a flag."""
    def no_memory(*args: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_memory)
    with pytest.raises(ValueError, match=r"could not map 1\.00 GiB of the KV cache: Cannot allocate memory; lower "
                                         r"--kv-cache-memory or --num-kv-blocks"):
        zeros((2**28,), torch.float32, "cpu")
