from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvserve.kv.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_gives_distinct_held_blocks() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert all(pool.ref_count(b) == 1 for b in blocks)
    assert pool.num_free_blocks == 1


def test_allocate_more_than_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks but only 1 are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_a_shared_block_returns_to_the_free_queue_only_at_zero() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.incref([block])
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.num_free_blocks == 2


def test_the_last_freed_block_is_reused_first_and_untouched_ones_stay_untouched() -> None:
    """A lazily mapped pool takes memory for the blocks ever used: a trickle of one-block requests reuses one."""
    pool = BlockPool(4)
    for _ in range(5):
        (block,) = pool.allocate(1)
        pool.free([block])
    assert pool.allocate(1) == [block]
    second, third = pool.allocate(2)
    pool.free([third])
    pool.free([second])
    assert pool.allocate(2) == [second, third] and pool.allocate(1) not in ([block], [second], [third])


@pytest.mark.parametrize("action", ["free", "incref"])
def test_a_free_block_cannot_be_freed_or_shared(action: str) -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 1 is"):
        getattr(pool, action)([1])


def test_bad_ids_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 block"):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="out of range"):
        pool.ref_count(2)
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)


def test_check_integrity_catches_a_corrupted_worthless_queue() -> None:
    pool = BlockPool(3)
    (held,) = pool.allocate(1)
    pool.check_integrity()
    pool._worthless[held] = None  # a held block in the queue of unheld worthless blocks
    with pytest.raises(AssertionError, match="still held"):
        pool.check_integrity()


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / incref / free against a model: each handle is one holder of a list of blocks."""

    NUM_BLOCKS = 12
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS)
        self.holders: dict[int, int] = {}

    def _count(self, blocks: list[int], delta: int) -> None:
        for b in blocks:
            self.holders[b] = self.holders.get(b, 0) + delta

    @rule(target=handles, n=st.integers(0, 5))
    def allocate(self, n: int) -> list[int]:
        if n > self.pool.num_free_blocks:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return []
        blocks = self.pool.allocate(n)
        assert all(self.holders.get(b, 0) == 0 for b in blocks), "allocated a held block"
        self._count(blocks, +1)
        return blocks

    @rule(target=handles, blocks=handles)
    def share(self, blocks: list[int]) -> list[int]:
        self.pool.incref(blocks)
        self._count(blocks, +1)
        return list(blocks)

    @rule(blocks=consumes(handles))
    def free(self, blocks: list[int]) -> None:
        self.pool.free(blocks)
        self._count(blocks, -1)

    @invariant()
    def counts_match_the_model(self) -> None:
        for b in range(self.NUM_BLOCKS):
            assert self.pool.ref_count(b) == self.holders.get(b, 0)
        assert self.pool.num_free_blocks == sum(1 for b in range(self.NUM_BLOCKS) if not self.holders.get(b))
        self.pool.check_integrity()


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
