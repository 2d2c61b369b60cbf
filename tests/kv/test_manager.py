from __future__ import annotations

import pytest

from kvserve.kv.manager import KVCacheManager, NoFreeBlocksError
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def request(request_id: str = "r", num_computed: int = 0) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(), num_computed_tokens=num_computed)


def test_allocate_slots_grows_the_block_table_to_fit_the_new_tokens() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = request()
    assert kv.allocate_slots(r, 5) and len(r.block_ids) == 2
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3) and len(r.block_ids) == 2  # 8 tokens still fit in 2 blocks
    assert kv.allocate_slots(r, 4) and len(r.block_ids) == 3
    assert kv.num_free_blocks() == 5
    assert kv.usage() == pytest.approx(3 / 8)
    kv.check_integrity([r])


def test_allocate_slots_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = request("a"), request("b")
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 8)
    assert b.block_ids == [] and kv.num_free_blocks() == 1
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.allocate_slots(b, -1)


def test_free_returns_every_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    r = request()
    kv.allocate_slots(r, 7)
    kv.free(r)
    assert r.block_ids == [] and kv.num_free_blocks() == 4 and kv.usage() == 0.0
    kv.check_integrity([r])


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = request("p", num_computed=0)
    kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    child = request("c")
    copies = kv.fork(parent, child)
    assert child.block_ids[:2] == parent.block_ids[:2]
    assert copies == [(parent.block_ids[2], child.block_ids[2])]
    assert child.block_ids[2] not in parent.block_ids
    assert [kv.pool.ref_count(b) for b in parent.block_ids] == [2, 2, 1]
    kv.check_integrity([parent, child])
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks() == 8


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    parent = request("p")
    kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    child = request("c")
    assert kv.fork(parent, child) == []
    assert child.block_ids == parent.block_ids
    kv.check_integrity([parent, child])


def test_fork_without_a_free_block_raises_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent = request("p")
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = request("c")
    with pytest.raises(NoFreeBlocksError):
        kv.fork(parent, child)
    assert child.block_ids == [] and [kv.pool.ref_count(b) for b in parent.block_ids] == [1, 1]
    kv.check_integrity([parent])


def test_fork_into_a_request_holding_blocks_is_refused() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    parent, child = request("p"), request("c")
    kv.allocate_slots(parent, 4)
    kv.allocate_slots(child, 4)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.fork(parent, child)


def test_check_integrity_catches_a_leak_and_a_phantom_holder() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = request("a"), request("b")
    kv.allocate_slots(a, 4)
    kv.allocate_slots(b, 4)
    with pytest.raises(AssertionError, match="reference count, live holders"):
        kv.check_integrity([a])  # b's block is held by nobody the caller knows: a leak
    b.block_ids.append(a.block_ids[0])  # b claims a block it does not hold
    with pytest.raises(AssertionError, match="disagree"):
        kv.check_integrity([a, b])
    b.block_ids.append(b.block_ids[0])
    with pytest.raises(AssertionError, match="more than once"):
        kv.check_integrity([a, b])
