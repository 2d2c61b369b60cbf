"""n > 1 forks (``sched/forks.py``) through a scheduler and a fake runner: samples share the parent's full blocks and
copy its partial one, and wait as if preempted where no seat or block is free."""

from __future__ import annotations

from tests.sched.sched_fakes import (
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


def test_n_samples_fork_sharing_full_blocks_and_copying_the_partial_one() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("p", 6, n=3, max_tokens=5, logprobs=0))
    sched_out, outputs = step(scheduler, runner)
    (row,) = sched_out.requests  # all but the last prompt token, then the fork
    assert (row.num_tokens, row.sample, outputs) == (5, False, [])
    parent, c1, c2 = (scheduler.requests[rid] for rid in ("p", "p#1", "p#2"))
    assert (c1.parent_id, c1.sample_index, c2.sample_index) == ("p", 1, 2)
    assert parent.block_ids[0] == c1.block_ids[0] == c2.block_ids[0]
    assert scheduler.kv.pool.ref_count(parent.block_ids[0]) == 3
    assert len({parent.block_ids[1], c1.block_ids[1], c2.block_ids[1]}) == 3

    sched_out, outputs = step(scheduler, runner)  # each sample runs the last prompt token and samples
    src = parent.block_ids[1]
    assert sched_out.kv_transfers.copies == ((src, c1.block_ids[1]), (src, c2.block_ids[1]))
    assert [n.request_id for n in sched_out.new_requests] == ["p#1", "p#2"]
    assert [(r.request_id, r.start_pos, r.num_tokens, r.sample) for r in sched_out.requests] == [
        ("p", 5, 1, True), ("p#1", 5, 1, True), ("p#2", 5, 1, True),
    ]
    assert [o.request_id for o in outputs] == ["p", "p#1", "p#2"]
    assert [o.new_token_ids for o in outputs] == [[default_token(rid, 0)] for rid in ("p", "p#1", "p#2")]
    assert all(len(o.logprobs) == 1 for o in outputs)
    outputs = run_to_completion(scheduler, runner)
    for rid in ("p#1", "p#2"):  # the fake KV check proved each sample read its own, correctly copied history
        assert tokens_of(outputs[rid]) == expected_tokens(rid, 5)[1:]
    assert runner.moved.num_copies == 2
    assert_all_blocks_free(scheduler)


def test_a_fork_at_a_block_boundary_needs_no_copy() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("p", 9, n=2, max_tokens=3))  # forks with 8 tokens computed
    step(scheduler, runner)
    sched_out, _ = step(scheduler, runner)
    assert not sched_out.kv_transfers
    run_to_completion(scheduler, runner)
    assert_all_blocks_free(scheduler)


def test_a_one_token_prompt_forks_at_admission() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("p", 1, n=3, max_tokens=2))
    sched_out, outputs = step(scheduler, runner)
    assert [(r.request_id, r.num_tokens) for r in sched_out.requests] == [("p", 1)]
    outputs = run_to_completion(scheduler, runner)
    assert {rid: tokens_of(outputs[rid]) for rid in ("p#1", "p#2")} == {
        rid: expected_tokens(rid, 2) for rid in ("p#1", "p#2")
    }
    assert_all_blocks_free(scheduler)


def test_samples_that_finish_on_their_first_token_free_everything() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("p", 6, n=4, max_tokens=1))
    step(scheduler, runner)
    _, outputs = step(scheduler, runner)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        (rid, FinishReason.LENGTH) for rid in ("p", "p#1", "p#2", "p#3")
    ]
    assert_all_blocks_free(scheduler)
    sched_out = scheduler.schedule()
    assert not sched_out.kv_transfers and sched_out.finished_request_ids == {"p", "p#1", "p#2", "p#3"}


def test_a_fork_with_no_block_free_for_its_copy_waits_and_recomputes() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("p", 6, n=2, max_tokens=2))
    step(scheduler, runner)
    child = scheduler.requests["p#1"]
    assert child.status is RequestStatus.PREEMPTED and child.block_ids == [] and child.num_output_tokens == 0
    outputs = run_to_completion(scheduler, runner)
    assert tokens_of(outputs["p#1"]) == expected_tokens("p#1", 2)
    assert_all_blocks_free(scheduler)


def test_a_preempted_parent_does_not_fork_again() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("old", 4, max_tokens=12))
    parent = make_request("p", 4, n=2, max_tokens=6)
    scheduler.add_request(parent)
    outputs: dict[str, list[int]] = {}
    children = set()  # every Request object ever made for sample 1
    while scheduler.has_unfinished_requests():
        _, step_outputs = step(scheduler, runner)
        if "p#1" in scheduler.requests:
            children.add(id(scheduler.requests["p#1"]))
        for out in step_outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert parent.num_preemptions == 1 and len(children) == 1  # it forked on its first prompt pass only
    assert outputs == {rid: expected_tokens(rid, n) for rid, n in [("old", 12), ("p", 6), ("p#1", 6)]}


def test_no_more_samples_run_than_a_step_has_tokens_for() -> None:
    """Seats are ``max_num_seqs`` but no more than the step's token budget (``SchedulerConfig.max_running``): an
    n = 64 request under a 32-token budget ran 64 samples, and the last 32 held their KV, idle, for as long as
    the first 32 ran (their whole generation). Each running sample now gets its token every step."""
    scheduler = make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=8, max_num_seqs=16)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("p", 3, n=12, max_tokens=6))
    num_steps = 0
    while scheduler.has_unfinished_requests():
        running = [r.request_id for r in scheduler.running]
        sched_out, _ = step(scheduler, runner)
        num_steps += 1
        assert len(running) <= 8 and set(running) <= {r.request_id for r in sched_out.requests}
    assert num_steps < 40
    assert_all_blocks_free(scheduler)


def test_samples_keep_their_parents_cache_salt() -> None:
    """A sample's blocks hang under its salt's root, as its parent's: made without the salt, its path ended under
    another salt's root (a KV-integrity failure), and its blocks would be found by requests of no salt."""
    scheduler = make_scheduler(block_size=4, prefix_caching=True)
    runner = runner_for(scheduler)
    parent = make_request("p", 9, n=3, max_tokens=8)
    parent.cache_salt = "tenant"
    scheduler.add_request(parent)
    step(scheduler, runner)
    assert [scheduler.requests[rid].cache_salt for rid in ("p", "p#1", "p#2")] == ["tenant"] * 3
    outputs = run_to_completion(scheduler, runner)  # checks KV integrity after every step
    assert all(tokens_of(outputs[rid]) == expected_tokens(rid, 8) for rid in ("p", "p#1", "p#2"))
    unsalted = make_request("q", 9, max_tokens=1)
    unsalted.prompt_token_ids = parent.prompt_token_ids
    assert scheduler.kv.match_prefix(unsalted).num_tokens == 0
    assert_all_blocks_free(scheduler)
