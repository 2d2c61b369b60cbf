"""The ``priority`` policy: the waiting queue in rank order (priority, then arrival), the lowest ranked running
request preempted when KV runs out (its tokens of the step given back), a waiting request displacing running ones
of a higher priority value, and never one of its own; running decodes keep their token each step."""

from __future__ import annotations

import pytest
from tests.sched.sched_fakes import (
    FakeRunner,
    assert_all_blocks_free,
    expected_tokens,
    fake_tiers,
    make_request,
    make_scheduler,
    run_to_completion,
    runner_for,
    step,
    tokens_of,
)

from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import InvalidParameter


def ranked(request_id: str, num_prompt: int, priority: int, **params) -> Request:
    request = make_request(request_id, num_prompt, **params)
    request.priority = priority
    return request


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def admission_order(scheduler, runner) -> list[str]:
    """Step to the end: the requests in the order they were first scheduled."""
    order: list[str] = []
    while scheduler.has_unfinished_requests():
        sched_out, _ = step(scheduler, runner)
        order += [rid for rid in ids(sched_out.requests) if rid not in order]
    return order


def tokens_by_request(*step_outputs) -> dict[str, list[int]]:
    """Each request's tokens over steps' outputs (lists from ``step``, dicts from ``run_to_completion``)."""
    tokens: dict[str, list[int]] = {}
    for outputs in step_outputs:
        for out in (o for outs in outputs.values() for o in outs) if isinstance(outputs, dict) else outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    runner = runner_for(scheduler)
    for rid, priority in [("late", 5), ("b", 1), ("urgent", -1), ("c", 1), ("a", 0)]:
        scheduler.add_request(ranked(rid, 3, priority, max_tokens=2))
    assert ids(scheduler.waiting) == ["urgent", "a", "b", "c", "late"]
    assert admission_order(scheduler, runner) == ["urgent", "a", "b", "c", "late"]
    assert scheduler.num_preemptions == 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_request_of_a_lower_value_takes_the_seat_of_a_running_one(preemption_mode: str) -> None:
    tiers = fake_tiers(4, 16) if preemption_mode == "swap" else None
    scheduler = make_scheduler(max_num_seqs=1, policy="priority", preemption_mode=preemption_mode, tiers=tiers)
    runner = FakeRunner(scheduler.kv.num_blocks_total, scheduler.kv.block_size, ref_count=scheduler.kv.pool.ref_count,
                        tiers=tiers)
    scheduler.add_request(ranked("background", 5, 3, max_tokens=10))
    before = [step(scheduler, runner)[1] for _ in range(4)]
    scheduler.add_request(ranked("urgent", 3, 0, max_tokens=3))
    sched_out, displacing = step(scheduler, runner)
    assert ids(sched_out.requests) == ["urgent"]
    background = scheduler.requests["background"]
    assert background.status is RequestStatus.PREEMPTED and scheduler.num_preemptions == 1
    if tiers is not None:
        assert scheduler.kv.swap.counters.num_swapped_out == 1
    tokens = tokens_by_request(*before, displacing, run_to_completion(scheduler, runner))
    assert tokens["urgent"] == expected_tokens("urgent", 3)
    # preempted mid-decode, it goes on with exactly the tokens it would have had
    assert tokens["background"] == expected_tokens("background", 10)
    assert_all_blocks_free(scheduler)


def test_a_request_of_a_lower_value_takes_the_blocks_of_running_ones_the_lowest_ranked_first() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, policy="priority")
    runner = runner_for(scheduler)
    scheduler.add_request(ranked("mid", 7, 2, max_tokens=3))  # 2 blocks, with its outputs 3
    scheduler.add_request(ranked("low", 7, 5, max_tokens=3))
    step(scheduler, runner)
    assert ids(scheduler.running) == ["mid", "low"] and scheduler.kv.num_free_blocks() == 2
    scheduler.add_request(ranked("urgent", 12, 0, max_tokens=1))  # 3 blocks for its prompt
    sched_out, _ = step(scheduler, runner)
    assert "urgent" in ids(sched_out.requests)
    assert scheduler.requests["low"].status is RequestStatus.PREEMPTED
    assert scheduler.requests["mid"].status is RequestStatus.RUNNING
    run_to_completion(scheduler, runner)
    assert scheduler.num_preemptions == 1
    assert_all_blocks_free(scheduler)


def test_requests_of_equal_priority_never_displace_each_other() -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    runner = runner_for(scheduler)
    scheduler.add_request(ranked("first", 4, 1, max_tokens=6))
    step(scheduler, runner)
    scheduler.add_request(ranked("second", 4, 1, max_tokens=2))
    scheduler.add_request(ranked("lower", 4, 2, max_tokens=2))
    assert admission_order(scheduler, runner) == ["first", "second", "lower"]
    assert scheduler.num_preemptions == 0


def test_kv_running_out_preempts_the_lowest_ranked_not_the_newest() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, policy="priority")
    runner = runner_for(scheduler)
    scheduler.add_request(ranked("low", 4, 1, max_tokens=8))
    steps = [step(scheduler, runner)[1]]
    scheduler.add_request(ranked("high", 4, 0, max_tokens=8))  # newer, but ranked first
    steps.append(step(scheduler, runner)[1])
    assert ids(scheduler.running) == ["low", "high"]  # admission order: "low" is scheduled first each step
    while scheduler.num_preemptions == 0:
        steps.append(step(scheduler, runner)[1])
    assert scheduler.requests["low"].status is RequestStatus.PREEMPTED
    assert scheduler.requests["high"].status is RequestStatus.RUNNING
    tokens = tokens_by_request(*steps, run_to_completion(scheduler, runner))
    assert tokens == {rid: expected_tokens(rid, 8) for rid in ("low", "high")}
    assert_all_blocks_free(scheduler)


def test_samples_of_an_n_request_keep_its_rank() -> None:
    scheduler = make_scheduler(max_num_seqs=4, policy="priority")
    runner = runner_for(scheduler)
    scheduler.add_request(ranked("low", 3, 4, max_tokens=6))
    step(scheduler, runner)
    scheduler.add_request(ranked("pair", 3, 1, max_tokens=4, n=2))
    step(scheduler, runner)
    assert ids(scheduler.running) == ["low", "pair", "pair#1"]
    assert scheduler.requests["pair#1"].priority == 1
    assert scheduler._victim().request_id == "low"  # the samples outrank it
    outputs = run_to_completion(scheduler, runner)
    assert tokens_of(outputs["pair#1"]) == expected_tokens("pair#1", 4)
    assert_all_blocks_free(scheduler)


def test_a_waiting_request_that_outranks_the_running_ones_stops_overlapped_continuation() -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    runner = runner_for(scheduler)
    scheduler.add_request(ranked("background", 3, 2, max_tokens=20))
    step(scheduler, runner)
    decode = scheduler.schedule()
    scheduler.add_request(ranked("same", 3, 2, max_tokens=2))
    assert scheduler.schedule_continuation(decode) is not None  # an equal one waits for the seat
    scheduler.update_from_output(decode, runner.execute(decode))
    decode = scheduler.schedule()
    scheduler.add_request(ranked("urgent", 3, 0, max_tokens=2))
    assert scheduler.schedule_continuation(decode) is None  # schedule() must displace for it


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_priority_needs_the_priority_policy(policy: str) -> None:
    scheduler = make_scheduler(policy=policy)
    scheduler.add_request(ranked("zero", 3, 0, max_tokens=2))  # the default goes under any policy
    with pytest.raises(InvalidParameter, match="--scheduling-policy priority") as refused:
        scheduler.add_request(ranked("urgent", 3, -1, max_tokens=2))
    assert refused.value.param == "priority"
    assert "urgent" not in scheduler.requests and ids(scheduler.waiting) == ["zero"]


def test_a_long_queue_keeps_rank_order_as_requests_arrive_and_are_preempted() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=2, max_num_seqs=3, max_num_batched_tokens=6,
                               policy="priority")
    runner = runner_for(scheduler)
    steps = []
    for i in range(24):
        scheduler.add_request(ranked(f"r{i}", 2 + i % 5, (i * 7) % 4, max_tokens=1 + i % 6))
        steps.append(step(scheduler, runner)[1])
        ranks = [(r.priority, r.arrival_time) for r in scheduler.waiting]
        assert ranks == sorted(ranks)
    tokens = tokens_by_request(*steps, run_to_completion(scheduler, runner))
    assert scheduler.num_preemptions > 0  # the queue was reordered by preemptions as well as arrivals
    assert tokens == {f"r{i}": expected_tokens(f"r{i}", 1 + i % 6) for i in range(24)}
    assert_all_blocks_free(scheduler)


def test_a_running_decode_keeps_its_token_while_a_newer_urgent_prompt_fills_in_chunks() -> None:
    """Running requests keep admission order: the low-priority stream decodes every step, the urgent prompt taking
    what is left of the budget (ranking the running list put its chunks first and starved the stream)."""
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, policy="priority")
    runner = runner_for(scheduler)
    scheduler.add_request(ranked("stream", 3, 5, max_tokens=30))
    step(scheduler, runner)
    scheduler.add_request(ranked("urgent", 64, 0, max_tokens=2))
    rows = [dict((r.request_id, r.num_tokens) for r in step(scheduler, runner)[0].requests) for _ in range(6)]
    assert all(row.get("stream") == 1 for row in rows), rows
    assert all(row.get("urgent") == 7 for row in rows), rows


def test_kv_running_out_preempts_the_lowest_ranked_even_when_it_was_scheduled_this_step() -> None:
    """The victim was already given its token this step: the token goes back to the budget and it is not run."""
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=3, policy="priority")
    runner = runner_for(scheduler)
    scheduler.add_request(ranked("low", 4, 3, max_tokens=12))
    steps = [step(scheduler, runner)[1]]
    scheduler.add_request(ranked("high", 4, 0, max_tokens=12))
    assert ids(scheduler.running) == ["low"]
    while scheduler.num_preemptions == 0:
        sched_out, outputs = step(scheduler, runner)
        steps.append(outputs)
    assert ids(sched_out.requests) == ["high"]  # "low", first in admission order, was taken back
    assert scheduler.requests["low"].status is RequestStatus.PREEMPTED
    assert sched_out.num_tokens == 1
    tokens = tokens_by_request(*steps, run_to_completion(scheduler, runner))
    assert tokens == {rid: expected_tokens(rid, 12) for rid in ("low", "high")}
    assert_all_blocks_free(scheduler)
