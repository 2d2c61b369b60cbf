"""BlockPool: fixed-size KV blocks named by ints, with reference counts and an O(1) free queue.

A block is either free (reference count 0, in the free queue) or held by one or more requests (count >= 1,
not in the queue). Freed blocks join the tail of the queue and allocation takes from the head, so the blocks
freed longest ago are reused first: the order an LRU prefix cache wants when it later keeps freed blocks.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (reference count 1 each); raises NoFreeBlocksError, taking none,
        when fewer are free."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks but only {len(self._free)} are free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block; every block must already be held (a free block cannot be shared)."""
        for block_id in block_ids:
            if self.ref_count(block_id) == 0:
                raise ValueError(f"block {block_id} is free; only a held block can gain another holder")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; a block whose count reaches 0 joins the tail of the free queue."""
        for block_id in block_ids:
            if self.ref_count(block_id) == 0:
                raise ValueError(f"block {block_id} is already free")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def check_integrity(self) -> None:
        """The free queue holds exactly the blocks with reference count 0, each once; raises AssertionError."""
        free = set(self._free)
        assert len(free) == len(self._free), f"the free queue holds a block twice: {sorted(self._free)}"
        unqueued = [b for b, count in enumerate(self._ref_counts) if count == 0 and b not in free]
        assert not unqueued, f"blocks {unqueued} have reference count 0 but are not in the free queue"
        held = [b for b in free if self._ref_counts[b] != 0]
        assert not held, f"blocks {held} are in the free queue but still held"

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range [0, {self.num_blocks})")
