from __future__ import annotations

import pytest
from tests.sched.sched_fakes import (
    FakeRunner,
    assert_all_blocks_free,
    default_token,
    expected_tokens,
    make_request,
    make_scheduler,
    run_to_completion,
    runner_for,
    step,
    tokens_of,
)

from kvserve.outputs import FinishReason
from kvserve.request import RequestStatus
from kvserve.sched.scheduler import Scheduler


# --------------------------------------------------------------------------------------- budget and order


def test_budget_and_max_num_seqs_hold_every_step_and_all_requests_finish() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    lengths = {f"r{i}": (3 + 5 * i, 2 + i) for i in range(7)}
    for rid, (num_prompt, max_tokens) in lengths.items():
        scheduler.add_request(make_request(rid, num_prompt, max_tokens=max_tokens))
    outputs = run_to_completion(scheduler, runner_for(scheduler))  # checks budget and seqs every step
    assert scheduler.num_preemptions == 0
    assert scheduler.num_tokens_computed == sum(p + m - 1 for p, m in lengths.values())
    for rid, (_, max_tokens) in lengths.items():
        assert tokens_of(outputs[rid]) == expected_tokens(rid, max_tokens)
        assert outputs[rid][-1].finish_reason is FinishReason.LENGTH
    assert_all_blocks_free(scheduler)


def test_chunked_prefill_with_an_8_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("long", 20, max_tokens=3))
    chunks = []
    for _ in range(3):
        sched_out, _ = step(scheduler, runner)
        chunks.append([(r.start_pos, r.num_tokens, r.sample) for r in sched_out.requests])
    assert chunks == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    for i, num_prompt in enumerate([5, 9, 13, 17]):
        scheduler.add_request(make_request(f"r{i}", num_prompt, max_tokens=4 + i))
    outputs = run_to_completion(scheduler, runner)
    assert len(tokens_of(outputs["long"])) == 2  # the third came with the last prompt chunk, above
    for i in range(4):
        assert tokens_of(outputs[f"r{i}"]) == expected_tokens(f"r{i}", 4 + i)
    assert_all_blocks_free(scheduler)


def test_one_token_rows_come_before_chunks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("a", 15, max_tokens=2))
    scheduler.add_request(make_request("b", 5, max_tokens=2))
    step(scheduler, runner)  # a: 8 tokens
    sched_out, _ = step(scheduler, runner)  # a: its last 7, b: the 1 left in the budget
    assert [(r.request_id, r.num_tokens) for r in sched_out.requests] == [("b", 1), ("a", 7)]
    sched_out, _ = step(scheduler, runner)  # a decodes, b continues its prompt
    assert [(r.request_id, r.num_tokens) for r in sched_out.requests] == [("a", 1), ("b", 4)]


def test_a_running_decode_is_scheduled_before_a_waiting_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("first", 3, max_tokens=4))
    step(scheduler, runner)
    scheduler.add_request(make_request("second", 30, max_tokens=1))
    sched_out, _ = step(scheduler, runner)
    assert [(r.request_id, r.num_tokens, r.sample) for r in sched_out.requests] == [
        ("first", 1, True), ("second", 9, False),
    ]


def test_waiting_requests_beyond_max_num_seqs_wait() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 2, max_tokens=3))
    sched_out, _ = step(scheduler, runner_for(scheduler))
    assert [r.request_id for r in sched_out.requests] == ["r0", "r1"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1



def test_samples_forked_at_admission_count_against_max_num_seqs() -> None:
    """A one-token prompt with n=2 forks as it is admitted and fills max_num_seqs=2: the next request waits
    until one of them finishes."""
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 1, n=2, max_tokens=4))
    scheduler.add_request(make_request("b", 5, max_tokens=4))
    runner = runner_for(scheduler)
    most_running = 0
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner)
        most_running = max(most_running, scheduler.num_running)
    assert most_running == 2 and not scheduler.has_unfinished_requests()

# ------------------------------------------------------------------------------------------- preemption


def test_preemption_under_a_tiny_pool_still_finishes_every_request_exactly() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=12)
    runner = runner_for(scheduler)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 4 + 2 * i, max_tokens=10))
    outputs = run_to_completion(scheduler, runner, max_steps=500)
    assert scheduler.num_preemptions > 0
    for i in range(5):  # preempted == uninterrupted: the same tokens, exactly max_tokens of them
        assert tokens_of(outputs[f"r{i}"]) == expected_tokens(f"r{i}", 10)
    assert_all_blocks_free(scheduler)


def test_the_newest_running_request_is_preempted_to_the_front_of_the_queue() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("old", 4, max_tokens=8))
    scheduler.add_request(make_request("new", 4, max_tokens=8))
    scheduler.add_request(make_request("later", 4, max_tokens=1))
    while scheduler.num_preemptions == 0:
        sched_out, _ = step(scheduler, runner)
    new = scheduler.requests["new"]
    assert [r.request_id for r in sched_out.requests] == ["old"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.block_ids == []
    assert new.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["new", "later"]


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=5)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("old", 4, max_tokens=12))
    scheduler.add_request(make_request("new", 4, max_tokens=8))
    while scheduler.num_preemptions == 0:
        sched_out, _ = step(scheduler, runner)
    # a 4-token chunk of "new" would fit in the block just freed; readmitting it now would only thrash
    assert scheduler.kv.num_free_blocks() == 1
    assert [(r.request_id, r.num_tokens) for r in sched_out.requests] == [("old", 1)]


def test_a_request_that_is_itself_the_newest_preempts_itself() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("old", 1, max_tokens=11))
    scheduler.add_request(make_request("new", 4, max_tokens=8))
    while scheduler.num_preemptions == 0:
        sched_out, _ = step(scheduler, runner)
    assert [r.request_id for r in sched_out.requests] == ["old"]
    new = scheduler.requests["new"]
    assert new.status is RequestStatus.PREEMPTED
    tokens_before = list(new.output_token_ids)
    outputs = run_to_completion(scheduler, runner)
    assert tokens_before + tokens_of(outputs["new"]) == expected_tokens("new", 8)


def test_a_recomputed_request_runs_its_outputs_again_and_samples_the_next_token() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("old", 4, max_tokens=8))
    scheduler.add_request(make_request("new", 4, max_tokens=8))
    while scheduler.num_preemptions == 0:
        step(scheduler, runner)
    new = scheduler.requests["new"]
    num_outputs = new.num_output_tokens
    while new.num_computed_tokens == 0:
        sched_out, _ = step(scheduler, runner)
    (row,) = [r for r in sched_out.requests if r.request_id == "new"]
    (entry,) = [n for n in sched_out.new_requests if n.request_id == "new"]  # it re-enters the runner's batch
    assert entry.prompt_token_ids + entry.output_token_ids == new.prompt_token_ids + new.output_token_ids[:num_outputs]
    assert row.start_pos == 0 and row.num_tokens == new.num_prompt_tokens + num_outputs
    assert row.sample and new.num_output_tokens == num_outputs + 1


# --------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("num_prompt", "max_tokens", "message"),
    [
        (60, 10, r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 is over max_model_len=64"),
        (64, None, r"prompt \(64 tokens\) \+ max_tokens \(1\) = 65 is over max_model_len=64"),
        (30, 10, r"may grow to 40 tokens, over the whole KV cache \(8 blocks x 4 = 32 tokens\)"),
        (10, None, r"may grow to 64 tokens, over the whole KV cache"),
    ],
)
def test_impossible_requests_are_refused_with_the_numbers(
    num_prompt: int, max_tokens: int | None, message: str
) -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=message):
        scheduler.add_request(make_request("r", num_prompt, max_tokens=max_tokens))
    assert not scheduler.has_unfinished_requests()


def test_empty_prompts_duplicate_ids_and_sample_like_ids_are_refused() -> None:
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="contains '#'"):
        scheduler.add_request(make_request("a#1", 3))
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add_request(make_request("r", 0))
    scheduler.add_request(make_request("r", 3))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("r", 3))


def test_an_id_still_in_a_step_in_flight_is_refused_until_the_step_is_back() -> None:
    """The overlapped loop updates a step after the next is scheduled: rows of a step scheduled before an abort
    must not land on a new request of the same id, so the id is refused until that step is back."""
    scheduler, runner = make_scheduler(num_blocks=16, block_size=4), FakeRunner(16, 4)
    scheduler.add_request(make_request("x", 6, max_tokens=8))
    in_flight = scheduler.schedule()
    scheduler.finish_requests(["x"], FinishReason.ABORT)
    with pytest.raises(ValueError, match="still in a step in flight"):
        scheduler.add_request(make_request("x", 3, max_tokens=2))
    assert scheduler.update_from_output(in_flight, runner.execute(in_flight)) == []
    scheduler.add_request(make_request("x", 3, max_tokens=2))  # the step is back: the id is free again
    outputs = run_to_completion(scheduler, runner)
    assert [o.new_token_ids for o in outputs["x"]] == [[default_token("x", 0)], [default_token("x", 1)]]
    assert scheduler.kv.num_free_blocks() == 16 and not scheduler._batch_mirror._retiring


# ------------------------------------------------------------------------------------- finish_requests


def test_finish_requests_on_waiting_running_preempted_and_unknown_ids() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("old", 4, max_tokens=8))
    scheduler.add_request(make_request("new", 4, max_tokens=8))
    scheduler.add_request(make_request("waiting", 4, max_tokens=8))
    while scheduler.num_preemptions == 0:
        step(scheduler, runner)
    assert scheduler.requests["new"].status is RequestStatus.PREEMPTED
    assert scheduler.requests["waiting"].status is RequestStatus.WAITING
    free_before = scheduler.kv.num_free_blocks()
    old = scheduler.requests["old"]
    num_old_blocks = len(old.block_ids)
    scheduler.finish_requests(["new", "waiting", "old", "unknown"], FinishReason.ABORT)
    assert scheduler.kv.num_free_blocks() == free_before + num_old_blocks == 4
    assert old.status is RequestStatus.FINISHED and old.finish_reason is FinishReason.ABORT
    assert_all_blocks_free(scheduler)
    sched_out = scheduler.schedule()
    assert sched_out.is_empty and sched_out.finished_request_ids == {"new", "waiting", "old"}
    assert scheduler.schedule().finished_request_ids == frozenset()


def test_a_request_finished_between_schedule_and_update_is_skipped() -> None:
    scheduler = make_scheduler()
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("a", 3, max_tokens=4))
    scheduler.add_request(make_request("b", 3, max_tokens=4))
    sched_out = scheduler.schedule()
    scheduler.finish_requests(["a"], FinishReason.STOP)
    outputs = scheduler.update_from_output(sched_out, runner.execute(sched_out))
    assert [o.request_id for o in outputs] == ["b"]
    scheduler.kv.check_integrity(scheduler.requests.values())
    assert scheduler.schedule().finished_request_ids == {"a"}


@pytest.mark.parametrize("after", [False, True], ids=["before-admit", "after-admit"])
def test_an_interrupt_while_admitting_leaves_every_request_in_one_queue(monkeypatch, after: bool) -> None:
    """A Ctrl-C in LLM.generate can land between a request's admission and its leaving the waiting queue: it
    was then in both, and once aborted stayed in the waiting queue, breaking every later step of the engine."""
    scheduler = make_scheduler(max_num_batched_tokens=64)
    for rid in ("a", "b", "c"):
        scheduler.add_request(make_request(rid, 5, max_tokens=3))
    admit, calls = Scheduler._admit, []

    def interrupted(self: Scheduler, request, prefix) -> None:
        calls.append(request.request_id)
        if len(calls) == 2 and not after:
            raise KeyboardInterrupt
        admit(self, request, prefix)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(Scheduler, "_admit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        scheduler.schedule()
    monkeypatch.setattr(Scheduler, "_admit", admit)
    assert not set(scheduler.running) & set(scheduler.waiting)
    scheduler.finish_requests(["a", "b", "c"], FinishReason.ABORT)  # what LLM.generate does on the way out
    assert_all_blocks_free(scheduler)
    scheduler.add_request(make_request("d", 5, max_tokens=3))
    outputs = run_to_completion(scheduler, runner_for(scheduler))
    assert tokens_of(outputs["d"]) == expected_tokens("d", 3)
