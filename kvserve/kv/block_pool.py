"""BlockPool: fixed-size KV blocks named by ints, with reference counts and O(1) queues of unheld blocks.

A block is held by one or more requests (reference count >= 1) or free (unheld, count 0): an allocation can
take it. A free block waits in one of two queues, each in the order blocks were released (head = released
longest ago), the worthless one taken from its tail (a stack), the evictable one from its head::

    worthless:  | free, content worthless |  -> allocation takes these first, the last released first
    evictable:  | free, content kept by the prefix cache (LRU) |  -> then these, evicting each, oldest first

Worthless blocks are a stack: the one released last is reused first, its pages resident and warm in the caches,
and a block no request ever needed is never touched, so that a lazily mapped pool (``KVCacheStorage``) takes
memory for the blocks a server's peak load held, not for all of them: taken oldest first, a trickle of short
requests walked through the whole pool (600 one-block requests made 163 MiB of SmolLM2's 2 GiB resident).

A block is *cached* while the prefix cache's tree names it (``mark_cached``); a cached block that loses its
last holder becomes evictable instead of worthless. Allocation never evicts while a worthless block is left, and
evicts the least recently released cached block first, telling the cache through ``on_evict``. A cache hit
takes an evictable block back (``take``) without copying anything.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for."""


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self._ref_counts = [0] * num_blocks
        self._cached = [False] * num_blocks
        # OrderedDicts as O(1) queues that also allow O(1) removal from the middle (a cache hit).
        self._worthless: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: the unheld ones, worthless or evictable."""
        return len(self._worthless) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        self._check_id(block_id)
        return self._cached[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks (reference count 1 each), worthless ones first (the last released first),
        then evicting the least recently released cached ones; raises NoFreeBlocksError, taking none, when too
        few are unheld."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        block_ids = []
        for _ in range(num_blocks):
            if self._worthless:
                block_id, _ = self._worthless.popitem()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block; every block must already be held (a free block cannot be shared)."""
        for block_id in block_ids:
            if self.ref_count(block_id) == 0:
                raise ValueError(f"block {block_id} is free; only a held block can gain another holder")
            self._ref_counts[block_id] += 1

    def take(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each cached block, taking an unheld one out of the evictable queue (a hit)."""
        for block_id in block_ids:
            if not self.is_cached(block_id):
                raise ValueError(f"block {block_id} is not cached; only cached blocks can be taken")
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; one whose count reaches 0 joins the tail of the evictable queue
        if cached, else of the worthless queue."""
        for block_id in block_ids:
            if self.ref_count(block_id) == 0:
                raise ValueError(f"block {block_id} is already free")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                queue = self._evictable if self._cached[block_id] else self._worthless
                queue[block_id] = None

    def mark_cached(self, block_id: int) -> None:
        """The prefix cache now names this held block: keep its content when it is released."""
        if self.ref_count(block_id) == 0:
            raise ValueError(f"block {block_id} is free; only a held block can be cached")
        self._cached[block_id] = True

    def unmark_cached(self, block_id: int) -> None:
        """The prefix cache dropped this held block: its content is worthless once released."""
        if self.ref_count(block_id) == 0:
            raise ValueError(f"block {block_id} is unheld; uncache it by eviction only")
        self._cached[block_id] = False

    def drop_cached(self, block_id: int) -> None:
        """The prefix cache let go of this unheld cached block without evicting it (its node left the tree): its
        content is worthless, and it moves from the evictable queue to the tail of the worthless one."""
        if self.ref_count(block_id) != 0 or not self._cached[block_id]:
            raise ValueError(f"block {block_id} is not an unheld cached block")
        del self._evictable[block_id]
        self._cached[block_id] = False
        self._worthless[block_id] = None

    def evictable_order(self) -> list[int]:
        """The evictable blocks, next to be evicted first."""
        return list(self._evictable)

    def check_integrity(self) -> None:
        """The two queues hold exactly the unheld blocks, each once, sorted by whether they are cached;
        raises AssertionError."""
        worthless, evictable = set(self._worthless), set(self._evictable)
        assert not worthless & evictable, f"blocks {sorted(worthless & evictable)} are in both queues"
        queued = worthless | evictable  # once: the union in the loop made the check quadratic in the pool
        unqueued = [b for b, count in enumerate(self._ref_counts) if count == 0 and b not in queued]
        assert not unqueued, f"blocks {unqueued} have reference count 0 but are in no queue"
        held = [b for b in queued if self._ref_counts[b] != 0]
        assert not held, f"blocks {held} are in a queue of unheld blocks but still held"
        wrong_worthless = [b for b in worthless if self._cached[b]]
        assert not wrong_worthless, f"cached blocks {wrong_worthless} are in the worthless queue, not the evictable one"
        wrong_evictable = [b for b in evictable if not self._cached[b]]
        assert not wrong_evictable, f"uncached blocks {wrong_evictable} are in the evictable queue"

    def _evict(self, block_id: int) -> None:
        self._cached[block_id] = False
        if self.on_evict is not None:
            self.on_evict(block_id)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range [0, {self.num_blocks})")
