"""Preemption by swap, against the real scheduler, KV manager and host tier over the fake runner's KV (token
ids as KV): a swapped-out request resumes with the same ``num_computed_tokens`` and the same KV, bit for bit,
and computes nothing again; finishing it while swapped out gives its host rows back; a host tier with no room
falls back to recompute, counted; pool, tree and host-row invariants hold after every step."""

from __future__ import annotations

import pytest

from kvserve.kv.block_keys import KeyedBlock, block_key
from kvserve.kv.tiers import TieredStore
from kvserve.outputs import FinishReason
from kvserve.request import RequestStatus
from kvserve.sched.scheduler import Scheduler
from tests.sched.sched_fakes import (
    FakeKVBytes,
    FakeRunner,
    default_token,
    fake_tiers,
    make_request,
    make_scheduler,
    offload_now,
    run_to_completion,
    step,
    tokens_of,
)


def _swapping(num_blocks: int = 6, host_blocks: int = 32, prefix_caching: bool = False,
              **options) -> tuple[Scheduler, FakeRunner, TieredStore]:
    tiers = fake_tiers(4, host_blocks)
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, prefix_caching=prefix_caching, tiers=tiers,
                               preemption_mode="swap", **options)
    runner = FakeRunner(num_blocks, 4, ref_count=scheduler.kv.pool.ref_count, tiers=tiers)
    return scheduler, runner, tiers


def _kv_of(runner: FakeRunner, block_ids: list[int], num_tokens: int) -> list[int | None]:
    slots = [slot for block_id in block_ids for slot in runner.kv[block_id]]
    return slots[:num_tokens]


def _host_rows_all_back(scheduler: Scheduler, tiers: TieredStore) -> bool:
    """After one more plan (rows go back to the tier at the plan after their last copy): every row free or
    holding a cached block."""
    scheduler.kv.take_tier_transfers()
    host = tiers.host
    return len(host._free) + host.num_blocks == host.num_rows


def _preempt_one(scheduler: Scheduler, runner: FakeRunner) -> None:
    while scheduler.num_preemptions == 0:
        step(scheduler, runner)


def _tokens_so_far(scheduler: Scheduler, request_id: str) -> list[int]:
    return list(scheduler.requests[request_id].output_token_ids)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_swapped_request_resumes_where_it_stopped_with_its_kv_bit_identical(prefix_caching: bool) -> None:
    """The block freed by the swap-out goes to the request that preempted it, which writes it in the same step:
    the plan copies it out first."""
    scheduler, runner, tiers = _swapping(prefix_caching=prefix_caching, max_num_seqs=2)
    scheduler.add_request(make_request("old", 6, max_tokens=12))
    scheduler.add_request(make_request("new", 4, max_tokens=12))  # preempted with 10 tokens computed
    while scheduler.num_preemptions == 0:
        new_block_ids = list(scheduler.requests["new"].block_ids)
        sched_out, _ = step(scheduler, runner)
    assert set(new_block_ids) & set(scheduler.requests["old"].block_ids), "no freed block reused in the step"
    assert [block_id for block_id, _ in sched_out.kv_transfers.swap_outs] == new_block_ids[:3]
    new = scheduler.requests["new"]
    assert new.status is RequestStatus.PREEMPTED and new.block_ids == [] and scheduler.kv.is_swapped_out(new)
    num_computed = new.num_computed_tokens
    assert num_computed % 4, "the test wants a partly filled last block"
    swapped_kv = list(new.token_ids[:num_computed])
    while scheduler.kv.is_swapped_out(new):
        sched_out, _ = step(scheduler, runner)
    row = next(r for r in sched_out.requests if r.request_id == "new")
    assert row.start_pos == num_computed, "resumed where it stopped"
    assert _kv_of(runner, new.block_ids, num_computed) == swapped_kv  # loaded back before the row ran
    tokens = _tokens_so_far(scheduler, "new")
    outputs = run_to_completion(scheduler, runner)
    assert tokens + tokens_of(outputs["new"]) == [default_token("new", k) for k in range(12)]
    assert scheduler.num_tokens_computed == (6 + 12 - 1) + (4 + 12 - 1), "a token computed twice"
    stats = scheduler.preemption_stats()
    assert stats["num_swapped_out"] == stats["num_swapped_in"] == stats["num_preemptions"] > 0
    assert stats["num_blocks_swapped_in"] == runner.moved.num_swapped_in > 0
    num_restored = stats["num_blocks_swapped_in"] + stats["num_blocks_swap_in_found_on_device"]
    assert stats["num_blocks_swapped_out"] == num_restored
    assert stats["num_swap_fallbacks"] == 0
    assert scheduler.kv.num_free_blocks() == 6 and _host_rows_all_back(scheduler, tiers)


def test_aborting_a_swapped_out_request_gives_its_host_rows_back() -> None:
    scheduler, runner, tiers = _swapping(max_num_seqs=2)
    scheduler.add_request(make_request("old", 6, max_tokens=12))
    scheduler.add_request(make_request("new", 4, max_tokens=12))
    _preempt_one(scheduler, runner)
    assert scheduler.kv.is_swapped_out(scheduler.requests["new"])
    scheduler.finish_requests(["new"], FinishReason.ABORT)
    scheduler.kv.check_integrity(scheduler.requests.values())  # the rows wait for the next plan, still counted
    assert "new" not in scheduler.kv.swap
    run_to_completion(scheduler, runner)
    assert scheduler.kv.num_free_blocks() == 6 and _host_rows_all_back(scheduler, tiers)


def test_a_request_aborted_between_schedule_and_execute_with_its_swap_out_planned_finishes_cleanly() -> None:
    """The swap-out's copy is in the plan already handed over; its rows go back only at the next plan (that
    no offload of this plan takes them is tests/kv/test_swap.py's)."""
    scheduler, runner, tiers = _swapping(num_blocks=6, host_blocks=3, prefix_caching=True, max_num_seqs=2)
    scheduler.add_request(make_request("old", 6, max_tokens=12))
    scheduler.add_request(make_request("new", 4, max_tokens=12))
    while True:
        sched_out = scheduler.schedule()
        if sched_out.kv_transfers.swap_outs:
            break
        scheduler.update_from_output(sched_out, runner.execute(sched_out))
    scheduler.finish_requests(["new"], FinishReason.ABORT)
    scheduler.update_from_output(sched_out, runner.execute(sched_out))
    scheduler.kv.check_integrity(scheduler.requests.values())
    run_to_completion(scheduler, runner)
    assert _host_rows_all_back(scheduler, tiers)


def test_a_host_tier_with_no_room_falls_back_to_recompute_counted() -> None:
    scheduler, runner, tiers = _swapping(host_blocks=1, max_num_seqs=2)  # too few rows for any swap-out
    scheduler.add_request(make_request("old", 6, max_tokens=12))
    scheduler.add_request(make_request("new", 4, max_tokens=12))
    _preempt_one(scheduler, runner)
    new = scheduler.requests["new"]
    assert new.num_computed_tokens == 0 and not scheduler.kv.is_swapped_out(new)
    tokens = _tokens_so_far(scheduler, "new")
    outputs = run_to_completion(scheduler, runner)
    assert tokens + tokens_of(outputs["new"]) == [default_token("new", k) for k in range(12)]
    stats = scheduler.preemption_stats()
    assert stats["num_swap_fallbacks"] == stats["num_preemptions"] > 0 and stats["num_swapped_out"] == 0
    assert _host_rows_all_back(scheduler, tiers)


def test_pinned_host_rows_are_not_taken_by_a_swap_out() -> None:
    scheduler, runner, tiers = _swapping(host_blocks=4, max_num_seqs=2)
    cached = [KeyedBlock(block_key(tiers.root_key, (i,) * 4), tiers.root_key, (i,) * 4) for i in range(2)]
    offload_now(tiers, FakeKVBytes(runner.kv), list(enumerate(cached)))
    assert tiers.pin([block.key for block in cached])  # as for loads planned: 2 of the 4 rows are pinned
    scheduler.add_request(make_request("old", 6, max_tokens=12))
    scheduler.add_request(make_request("new", 4, max_tokens=12))
    _preempt_one(scheduler, runner)  # "new" has 3 blocks to keep
    assert scheduler.preemption_stats()["num_swap_fallbacks"] == 1
    assert all(block.key in tiers.host for block in cached)


def test_a_sample_swapped_out_the_step_after_its_fork_keeps_its_copied_block() -> None:
    """Its partial block's copy-on-write is still in the plan: the copy lands before the swap-out reads it."""
    scheduler, runner, tiers = _swapping(num_blocks=4, max_num_seqs=3)
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    scheduler.add_request(make_request("p", 6, n=2, max_tokens=10))
    outputs: dict[str, list] = {}
    seen = False
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        sched_out, step_outputs = step(scheduler, runner)
        for out in step_outputs:
            outputs.setdefault(out.request_id, []).append(out)
        transfers = sched_out.kv_transfers
        copied_then_swapped = {dst for _, dst in transfers.copies} & {b for b, _ in transfers.swap_outs}
        if copied_then_swapped:
            assert "p#1" in scheduler.requests and scheduler.kv.is_swapped_out(scheduler.requests["p#1"])
            seen = True
    assert seen and not scheduler.has_unfinished_requests()
    for rid in ("a", "p", "p#1"):
        assert tokens_of(outputs[rid]) == [default_token(rid, k) for k in range(10)]
    assert scheduler.preemption_stats()["num_swap_fallbacks"] == 0 and _host_rows_all_back(scheduler, tiers)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_samples_under_a_tiny_pool_swap_and_compute_every_token_once(prefix_caching: bool) -> None:
    scheduler, runner, tiers = _swapping(num_blocks=8, prefix_caching=prefix_caching, max_num_seqs=4)
    lengths = {"a": (6, 8), "b": (9, 6), "c": (5, 10)}
    for rid, (num_prompt, max_tokens) in lengths.items():
        scheduler.add_request(make_request(rid, num_prompt, n=2, max_tokens=max_tokens))
    outputs = run_to_completion(scheduler, runner)
    for rid, (_, max_tokens) in lengths.items():
        for sample_id in (rid, f"{rid}#1"):
            assert tokens_of(outputs[sample_id]) == [default_token(sample_id, k) for k in range(max_tokens)]
    stats = scheduler.preemption_stats()
    assert stats["num_swapped_out"] > 0 and stats["num_swap_fallbacks"] == 0
    if not prefix_caching:  # each sample runs its prompt's last token and its outputs but the last; once each
        assert scheduler.num_tokens_computed == sum(p - 1 + 2 * m for p, m in lengths.values())
    assert scheduler.kv.num_free_blocks() == 8 and _host_rows_all_back(scheduler, tiers)


@pytest.mark.parametrize("host_blocks", [8, 1])
def test_a_fork_that_finds_no_block_counts_as_a_preemption(host_blocks: int) -> None:
    """A sample whose fork finds no block for its copy waits (in the host tier, or to recompute): a preemption, so
    that the swap counters stay within it: swapped out + fallen back <= preemptions."""
    tiers = fake_tiers(4, host_blocks)
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                               max_model_len=8, tiers=tiers, preemption_mode="swap")
    runner = FakeRunner(2, 4, ref_count=scheduler.kv.pool.ref_count, tiers=tiers)
    scheduler.add_request(make_request("a", 7, max_tokens=1, n=2))  # forked at 6 tokens: a full and a partial block
    outputs = run_to_completion(scheduler, runner)
    assert sorted(outputs) == ["a", "a#1"]
    stats = scheduler.preemption_stats()
    assert stats["num_preemptions"] == 1
    assert (stats["num_swapped_out"], stats["num_swap_fallbacks"]) == ((1, 0) if host_blocks == 8 else (0, 1))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_parked_sample_resumed_at_once_leaves_its_rows_to_the_offloads_of_that_plan_untouched(
    policy: str, tmp_path
) -> None:
    """A sample parked through the host tier (``fork_swapped``: no seat) and admitted at the very next schedule (a
    seat freed by an abort, or under priority by displacing a lower-ranked request) finds its parent's blocks on
    the device: its rows go back with that plan's take, before the plan's offloads (the parent's blocks written
    through) reserve rows. Its swap-out copies, planned in the update before, must not be made into them: they
    overwrote the offloads' rows, and a later hit on the prefix loaded another block's KV (stale)."""
    tiers = fake_tiers(4, 8, str(tmp_path))
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2, prefix_caching=True, policy=policy,
                               tiers=tiers, preemption_mode="swap")
    runner = FakeRunner(16, 4, ref_count=scheduler.kv.pool.ref_count, tiers=tiers)
    low = make_request("low", 8, max_tokens=20)
    low.priority = 2 if policy == "priority" else 0
    scheduler.add_request(low)
    step(scheduler, runner)
    parent = make_request("par", 9, max_tokens=3, n=2)
    parent.priority = 1 if policy == "priority" else 0
    scheduler.add_request(parent)
    step(scheduler, runner)  # the parent computes 8 tokens and forks; no seat: its sample is parked, swapped out
    assert scheduler.kv.is_swapped_out(scheduler.requests["par#1"])
    if policy == "fcfs":
        scheduler.finish_requests(["low"], FinishReason.ABORT)
    sched_out, _ = step(scheduler, runner)  # the sample is admitted on the parent's blocks, still on the device
    assert "par#1" in {r.request_id for r in sched_out.requests}
    assert sched_out.kv_transfers.offloads, "the parent's blocks written through in the same plan"
    transfers = sched_out.kv_transfers
    assert not {row for _, row in transfers.offloads} & {row for _, row in transfers.swap_outs}
    run_to_completion(scheduler, runner)
    pool = scheduler.kv.pool
    pool.free(pool.allocate(pool.num_free_blocks))  # every cached block leaves the device
    again = make_request("again", 10, prefix=parent.prompt_token_ids[:8], max_tokens=1)
    scheduler.add_request(again)
    sched_out, _ = step(scheduler, runner)  # the fake runner checks the KV loaded from the host tier
    assert len(sched_out.kv_transfers.loads) == 2
    run_to_completion(scheduler, runner)
    tiers.close()
