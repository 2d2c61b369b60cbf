"""KVCacheManager: the scheduler's only view of KV memory.

It owns the block pool and every request's block table (``request.block_ids``); nobody else allocates or
frees blocks. Blocks stay opaque ints to the scheduler. New blocks come from one place, ``_take_blocks``:
the seam where a prefix cache will first reuse cached blocks and evict unlocked ones.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from kvserve.kv.block_pool import BlockPool, NoFreeBlocksError
from kvserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_blocks_total(self) -> int:
        return self.pool.num_blocks

    @property
    def num_slots_total(self) -> int:
        """The most tokens the whole cache can hold."""
        return self.pool.num_blocks * self.block_size

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """The fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_ids`` so that its computed tokens plus ``num_new_tokens`` fit.

        All or nothing: returns False and changes nothing when the pool cannot supply the blocks::

            block_ids:  | b0 ......... | b1 ......... | b2 ...       | (new) ...    |
            tokens:     |<--- num_computed_tokens --->|<-- num_new_tokens -->|
                                                      ^ start of this step's chunk
            blocks needed = ceil((num_computed_tokens + num_new_tokens) / block_size) - len(block_ids)
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        num_needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if num_needed <= 0:
            return True
        if num_needed > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self._take_blocks(num_needed))
        return True

    def free(self, request: Request) -> None:
        """Release the request's hold on all its blocks (shared ones stay with their other holders)."""
        # Tail blocks first, so they are reused before the head (a prefix cache keeps heads longest).
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]]:
        """Give ``child`` (which holds no blocks) the KV of the parent's computed tokens, copy-on-write.

        The full blocks are shared (one more holder each); the partly filled last block, which both will
        go on writing, is copied into a fresh block. Returns the (src, dst) copies the runner must apply
        before the next forward pass. Raises NoFreeBlocksError, changing nothing, when no block is free::

            parent:  | full b0 | full b1 | b2: 3 of 4 slots |
            child:   | full b0 | full b1 | b7: copy of b2   |     (b0, b1 now held twice)
        """
        if child.block_ids:
            raise ValueError(f"request {child.request_id} already holds blocks; only a fresh request can fork")
        num_full, num_partial = divmod(parent.num_computed_tokens, self.block_size)
        shared = parent.block_ids[:num_full]
        copies = []
        if num_partial:
            (dst,) = self._take_blocks(1)
            copies.append((parent.block_ids[num_full], dst))
        self.pool.incref(shared)
        child.block_ids = shared + [dst for _, dst in copies]
        return copies

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Every block's reference count equals the number of the given live requests holding it, and free +
        held = total. ``requests`` must be every request that holds blocks. Raises AssertionError."""
        self.pool.check_integrity()
        holders: Counter[int] = Counter()
        for request in requests:
            duplicates = [b for b, count in Counter(request.block_ids).items() if count > 1]
            assert not duplicates, f"request {request.request_id} holds blocks {duplicates} more than once"
            holders.update(request.block_ids)
        wrong = {
            b: (self.pool.ref_count(b), holders[b])
            for b in range(self.pool.num_blocks)
            if self.pool.ref_count(b) != holders[b]
        }
        assert not wrong, f"block: (reference count, live holders) disagree: {wrong}"
        num_held = len(holders)
        assert self.pool.num_free_blocks + num_held == self.pool.num_blocks, (
            f"{self.pool.num_free_blocks} free + {num_held} held != {self.pool.num_blocks} blocks"
        )

    def _take_blocks(self, num_blocks: int) -> list[int]:
        return self.pool.allocate(num_blocks)


__all__ = ["KVCacheManager", "NoFreeBlocksError"]
