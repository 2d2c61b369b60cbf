"""SwapSpace over a real host tier: rows held out of the tier from swap-out to the plan after their last copy,
all or nothing, and never given to an offload of a plan that still copies through them."""

from __future__ import annotations

from kvserve.kv.block_keys import KeyedBlock, block_key
from kvserve.kv.swap import SwappedKV, SwapSpace
from kvserve.kv.tiers import Tier
from kvserve.worker.kv_transfers import HostCopies
from tests.sched.sched_fakes import FakeKVBytes, fake_tiers, load_now


def _kv() -> FakeKVBytes:
    return FakeKVBytes([[10 * b + s for s in range(4)] for b in range(4)])  # block b holds 10b .. 10b + 3


def test_a_row_goes_back_only_at_the_plan_after_its_last_copy() -> None:
    store, kv = fake_tiers(4, host_blocks=3), _kv()
    swap, host = SwapSpace(store), HostCopies(store.host_slab)
    assert swap.swap_out("r", [2, 3], num_tokens=7)
    assert swap.resume_point("r") == SwappedKV(7) and not swap.resume_point("r").must_wait
    outs, _ = swap.take_transfers()
    host.swap_out(kv, outs)
    kv.kv[2], kv.kv[3] = [None] * 4, [None] * 4  # the freed blocks are reused
    swap.swap_in("r", [0, 1])
    _, ins = swap.take_transfers()
    swap.check_integrity([])
    assert store.hold_rows(2) is None, "the swap-in's rows were given back before its copy"
    host.swap_in(kv, ins)
    assert kv.kv[0] == [20, 21, 22, 23] and kv.kv[1] == [30, 31, 32, 33]
    swap.take_transfers()
    swap.check_integrity([])
    assert len(store.host._free) == 3


def test_a_swap_out_too_big_for_the_free_and_unpinned_rows_takes_none() -> None:
    store = fake_tiers(4, host_blocks=3)
    swap = SwapSpace(store)
    assert swap.swap_out("a", [0, 1], num_tokens=8)
    assert not swap.swap_out("b", [2, 3], num_tokens=8)
    assert "b" not in swap and swap.counters.num_fallbacks == 1 and len(store.host._free) == 1
    swap.check_integrity(["a"])


def test_rows_of_a_request_aborted_before_its_swap_out_copy_are_not_lent_to_that_plans_offloads() -> None:
    """Aborted between ``schedule`` and ``execute``: the plan still copies its KV into the rows. An offload in
    the same plan (a cached block evicted that step) must not get those rows and be overwritten."""
    store, kv = fake_tiers(4, host_blocks=1), _kv()
    swap, host = SwapSpace(store), HostCopies(store.host_slab)
    assert swap.swap_out("r", [1], num_tokens=4)
    tokens = (0, 1, 2, 3)
    evicted = KeyedBlock(block_key(store.root_key, tokens), store.root_key, tokens)
    outs, _ = swap.take_transfers()  # the plan taken as the KV manager takes it: swap rows, then offload rows
    offloads = store.reserve_offload_rows([(0, evicted)])
    swap.drop("r")
    host.offload(kv, offloads)  # the runner applies the plan: offloads, then the swap-out
    host.swap_out(kv, outs)
    swap.take_transfers()
    swap.check_integrity([])
    if store.locate(evicted.key) is Tier.HOST:
        assert store.pin([evicted.key])
        load_now(store, kv, [(evicted.key, 2)])
        assert kv.kv[2] == [0, 1, 2, 3], "a cached block in the host tier holds another request's KV"
    assert len(store.host._free) + store.host.num_blocks == 1
