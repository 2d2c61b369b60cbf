"""The runner's side of the KV tiers and of swap: byte copies between the paged KV cache and the host slab's rows,
at the rows the KV manager chose when it planned them (``KVTransferPlan``).

It decides nothing and indexes nothing: which block a row holds, what is pinned and what goes to the disk are the
scheduler side's (``kv/tiers.py``, ``kv/swap.py``). It times the copies, which only the runner can.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvserve.kv.storage import KVCacheStorage


@dataclass
class CopyTotals:
    """Bytes and seconds copied one way since start."""

    num_bytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class HostCopies:
    """Copies between the paged KV and the host slab: offloads and swap-outs ((block_id, row) pairs) out, loads and
    swap-ins ((row, block_id) pairs) back in. ``after_offloads`` is called once a step's offloads are in their
    rows (the tiers publish them then, and queue their disk writes, so that the writer works during the step's
    forward pass)."""

    def __init__(self, host_slab: torch.Tensor, after_offloads: Callable[[], None] = lambda: None) -> None:
        self.host_slab = host_slab
        self.after_offloads = after_offloads
        self.offloaded = CopyTotals()
        self.loaded = CopyTotals()
        self.swapped = CopyTotals()  # out and back

    def offload(self, kv: KVCacheStorage, moves: Sequence[tuple[int, int]]) -> None:
        self._copy(kv.read_blocks, [block_id for block_id, _ in moves], [row for _, row in moves], self.offloaded)
        self.after_offloads()  # the copy is synchronous: the rows hold the blocks now

    def swap_out(self, kv: KVCacheStorage, moves: Sequence[tuple[int, int]]) -> None:
        self._copy(kv.read_blocks, [block_id for block_id, _ in moves], [row for _, row in moves], self.swapped)

    def load(self, kv: KVCacheStorage, moves: Sequence[tuple[int, int]]) -> None:
        self._copy(kv.write_blocks, [block_id for _, block_id in moves], [row for row, _ in moves], self.loaded)

    def swap_in(self, kv: KVCacheStorage, moves: Sequence[tuple[int, int]]) -> None:
        self._copy(kv.write_blocks, [block_id for _, block_id in moves], [row for row, _ in moves], self.swapped)

    def _copy(self, move: Callable[[list[int], torch.Tensor, list[int]], None], block_ids: list[int], rows: list[int],
              totals: CopyTotals) -> None:
        if not block_ids:
            return
        start = time.perf_counter()
        move(block_ids, self.host_slab, rows)
        totals.seconds += time.perf_counter() - start
        totals.num_bytes += len(rows) * self.host_slab.shape[1]

    def stats(self) -> dict[str, float]:
        """The copies' seconds and bandwidth (the blocks and bytes planned are ``TieredStore.stats``')."""
        return {
            "kv_offload_seconds": self.offloaded.seconds,
            "kv_offload_bandwidth_gbps": self.offloaded.gbps,
            "kv_reload_seconds": self.loaded.seconds,
            "kv_reload_bandwidth_gbps": self.loaded.gbps,
            "kv_swap_seconds": self.swapped.seconds,
        }
