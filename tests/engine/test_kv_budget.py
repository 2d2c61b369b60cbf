"""The KV pool's size: the KV cache held in host memory (a CPU pool, a host tier) larger than the memory the process
may take is refused at start, naming the flags, since its pages are taken only as its blocks fill; the default
budget fits a small container."""

from __future__ import annotations

import errno
import mmap
from pathlib import Path

import pytest
import torch

from kvserve import LLM, host_limits
from kvserve.config import CacheConfig
from kvserve.engine.kv_budget import DEFAULT_CPU_KV_CACHE_GIB, num_kv_blocks_for
from kvserve.kv.storage import zeros
from tests.cgroups import fake_cgroups

FLAGS = "lower --kv-cache-memory, --num-kv-blocks or --kv-offload-memory"


def container_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str) -> Path:
    return fake_cgroups(monkeypatch, tmp_path)("memory.max", text)


@pytest.mark.parametrize("options", [{"kv_cache_memory": 0.75},  # the pool alone
                                     {"kv_cache_memory": 0.3, "kv_offload_memory": 0.3}])  # the pool and the tier
def test_host_kv_memory_larger_than_the_containers_is_refused_naming_the_flags(
        monkeypatch, tmp_path: Path, tiny_checkpoints, options: dict) -> None:
    """A 64 GiB pool started on a 23 GiB machine: its pages, mapped untouched, would have been taken as the
    prefix cache filled, and the process killed for memory hours later. A pool and a host tier are summed."""
    limit = container_limit(monkeypatch, tmp_path, f"{2**29}\n")
    with pytest.raises(ValueError, match=rf"the KV cache in host memory \(0\.[68] GiB\) is larger than the memory "
                                         rf"limit of this container or service \({limit}\) \(0\.5 GiB\): .*; {FLAGS}"):
        LLM(str(tiny_checkpoints["llama"]), dtype="float32", **options)


def test_a_pool_capped_to_what_its_requests_can_fill_is_what_is_checked(monkeypatch, tmp_path: Path,
                                                                        tiny_checkpoints) -> None:
    """Without a prefix cache the pool is cut to what the running requests could fill: that, not the budget
    asked for, is what must fit."""
    container_limit(monkeypatch, tmp_path, f"{2**29}\n")
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory=4.0, enable_prefix_caching=False,
              max_num_seqs=2)
    assert llm.stats()["kv_cache_bytes"] < 2**29


def test_the_default_budget_takes_half_a_small_containers_memory(monkeypatch, tmp_path: Path) -> None:
    container_limit(monkeypatch, tmp_path, f"{2**30}")
    assert num_kv_blocks_for(CacheConfig(), 2**20, torch.device("cpu"), None) == 512  # 0.5 GiB of 1 MiB blocks
    container_limit(monkeypatch, tmp_path, "max\n")  # cgroup v2's "no limit" (v1 writes a huge number)
    assert num_kv_blocks_for(CacheConfig(), 2**20, torch.device("cpu"), None) == DEFAULT_CPU_KV_CACHE_GIB * 1024


def test_no_container_limit_leaves_the_machines_memory(monkeypatch, tmp_path: Path) -> None:
    container_limit(monkeypatch, tmp_path, "max\n")
    limit, where = host_limits.memory_limit()
    assert where == "this machine's memory" and limit is not None and limit > 2**28


def test_a_pool_the_address_space_cannot_map_is_named(monkeypatch) -> None:
    """Under `ulimit -v` the error was "[Errno 12] Cannot allocate memory", naming neither the pool nor a flag."""
    def no_memory(*args: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_memory)
    with pytest.raises(ValueError, match=r"could not map 1\.00 GiB of the KV cache: Cannot allocate memory; lower "
                                         r"--kv-cache-memory or --num-kv-blocks"):
        zeros((2**28,), torch.float32, "cpu")


def test_local_replicas_each_take_their_share_of_the_memory(monkeypatch, tmp_path: Path) -> None:
    """`serve --data-parallel-size N`'s replicas each checked their KV cache against, and took half of, the whole
    container's memory: N pools that fit one by one outgrew it together."""
    container_limit(monkeypatch, tmp_path, f"{2**31}")
    monkeypatch.setenv("KVSERVE_LOCAL_REPLICAS", "4")
    limit, where = host_limits.memory_limit()
    assert limit == 2**29 and where.startswith("a 1/4 share of the memory limit of this container or service (")
    assert where.endswith(") (one of 4 local replicas)")
    assert num_kv_blocks_for(CacheConfig(), 2**20, torch.device("cpu"), None) == 256  # half the share
