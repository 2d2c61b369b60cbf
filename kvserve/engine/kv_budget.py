"""How many KV blocks the pool gets: the user's count, else a memory budget (GiB on CPU, a share of free memory on
CUDA), never more than the running requests could fill when no prefix cache keeps the rest."""

from __future__ import annotations

import logging

import torch

from kvserve.config import CacheConfig
from kvserve.host_limits import memory_limit

DEFAULT_CPU_KV_CACHE_GIB = 2.0
logger = logging.getLogger(__name__)


def num_kv_blocks_for(cache: CacheConfig, bytes_per_block: int, device: torch.device, max_blocks_needed: int | None,
                      block_scale: int = 1) -> int:
    """How many blocks of ``bytes_per_block`` (every model's KV a block id holds) the pool gets: ``num_kv_blocks``
    if set, else a memory budget (``kv_cache_memory`` GiB, default 2 GiB on CPU; a fraction of free memory on
    CUDA), never more than ``max_blocks_needed`` (what the running requests could ever fill; None: the whole
    budget, which the prefix cache fills). ``num_kv_blocks`` counts blocks of every layer: with KV cache groups
    (``kv/groups.py``) a block holds 1 / ``block_scale`` of that, and the pool gets as many more."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks * block_scale
    if device.type == "cuda" and cache.kv_cache_memory is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = free_bytes * cache.gpu_memory_utilization
    else:
        if cache.gpu_memory_utilization != CacheConfig.gpu_memory_utilization:  # asked for, and changes nothing
            logger.warning("--gpu-memory-utilization is not used: the KV cache is sized by --kv-cache-memory "
                           "(default %s GiB off CUDA)", DEFAULT_CPU_KV_CACHE_GIB)
        budget = cache.kv_cache_memory * 2**30 if cache.kv_cache_memory else _default_cpu_budget()
    num_blocks = int(budget // bytes_per_block)
    if max_blocks_needed is not None and num_blocks > max_blocks_needed:
        logger.info("the KV budget (%.3f GiB) holds more than the running requests could ever fill, with no "
                    "prefix cache to keep: %d blocks", budget / 2**30, max_blocks_needed)
        num_blocks = max_blocks_needed
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget ({budget / 2**30:.3f} GiB) is smaller than one block "
            f"({bytes_per_block} bytes); raise kv_cache_memory"
        )
    return num_blocks


def _default_cpu_budget() -> float:
    """``DEFAULT_CPU_KV_CACHE_GIB``, or half the memory a smaller container allows."""
    limit, where = memory_limit()
    budget = DEFAULT_CPU_KV_CACHE_GIB * 2**30
    if limit is not None and budget > limit / 2:
        logger.info("the KV cache takes %.2f GiB, half of %s, not the default %s GiB", limit / 2**31, where,
                    DEFAULT_CPU_KV_CACHE_GIB)
        return limit / 2
    return budget


def check_fits_host_memory(pool_bytes: float, flags: str) -> None:
    """ValueError, naming ``flags``, where the KV cache in host memory (a CPU pool, a host tier) is larger than this
    process's memory: its pages are mapped untouched and taken as blocks fill (the prefix cache keeps every block
    once used), so a pool larger than the machine started fine and was killed for memory hours into serving."""
    limit, where = memory_limit()
    if limit is not None and pool_bytes > limit:
        raise ValueError(f"the KV cache in host memory ({pool_bytes / 2**30:.1f} GiB) is larger than {where} "
                         f"({limit / 2**30:.1f} GiB): it would be killed for memory as its blocks fill; lower {flags}")
