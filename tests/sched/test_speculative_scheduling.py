"""The scheduler's side of speculation, with a fake model output: a draft is scheduled as query tokens in the
budget, the request advances by the accepted drafts + 1 only, and blocks taken just for rejected drafts go
back to the pool (the prefix tree never holds a rejected token)."""

from __future__ import annotations

import dataclasses

import torch

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.sched.output import ModelOutput, TokenLogprobs
from kvserve.sched.scheduler import Scheduler
from kvserve.spec.policy import SpeculationPolicy
from kvserve.spec.proposer import DRAFT_SLOT
from kvserve.worker.input_batch import PersistentBatch

BLOCK_SIZE = 4
PROMPT = [5, 6, 7, 8, 5, 6, 7]  # "5 6 7" repeats: the proposer drafts "8 5 6 7 ..."


def _scheduler(num_blocks: int = 16) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, kv, SpeculationPolicy(SpeculativeConfig("ngram", 4, 1, 3)))


def _prefilled(scheduler: Scheduler, first_token: int = 8, **params) -> Request:
    request = Request("r", list(PROMPT), SamplingParams(**{"temperature": 0, "max_tokens": 20, **params}))
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelOutput({"r": [first_token]}))
    return request


def test_a_decode_runs_its_last_token_and_its_draft_within_the_budget() -> None:
    scheduler = _scheduler()
    request = _prefilled(scheduler)
    out = scheduler.schedule()
    (row,) = out.requests
    assert row.draft_token_ids == (5, 6, 7, 8)
    assert (row.start_pos, row.num_tokens, out.num_tokens) == (7, 5, 5)
    assert len(request.block_ids) == 3  # positions 0..11


def test_the_request_advances_by_the_accepted_drafts_and_frees_the_rejected_blocks() -> None:
    scheduler = _scheduler()
    request = _prefilled(scheduler)
    out = scheduler.schedule()
    free_before = scheduler.kv.num_free_blocks()
    outputs = scheduler.update_from_output(out, ModelOutput({"r": [5, 9]}))  # one draft accepted, then 9
    assert outputs[0].new_token_ids == [5, 9]
    assert request.output_token_ids == [8, 5, 9]
    assert request.num_computed_tokens == request.num_tokens - 1 == 9
    assert len(request.block_ids) == 3 and scheduler.kv.num_free_blocks() == free_before
    scheduler.kv.check_integrity([request])
    out = scheduler.schedule()  # the next row starts at the first uncomputed position
    assert out.requests[0].start_pos == 9


def test_blocks_taken_only_for_rejected_drafts_go_back_to_the_pool() -> None:
    scheduler = _scheduler()
    request = _prefilled(scheduler)
    scheduler.update_from_output(scheduler.schedule(), ModelOutput({"r": [5, 6, 7, 8, 5]}))  # all accepted
    assert request.num_computed_tokens == 12 and len(request.block_ids) == 3  # position 12 not yet taken
    out = scheduler.schedule()  # positions 12..16: a fifth block for position 16
    assert out.requests[0].num_tokens == 5 and len(request.block_ids) == 5
    free_before = scheduler.kv.num_free_blocks()
    scheduler.update_from_output(out, ModelOutput({"r": [1]}))  # every draft rejected
    assert request.num_tokens == 14 and len(request.block_ids) == 4
    assert scheduler.kv.num_free_blocks() == free_before + 1
    scheduler.kv.check_integrity([request])


def test_after_a_rejection_the_runner_holds_as_many_blocks_as_the_scheduler_counts_it_has() -> None:
    """Nothing in the step diff says how many blocks a verified row keeps: the runner's batch and the scheduler's
    count of the blocks sent each apply the rule (``PersistentBatch.drop_rejected_blocks``,
    ``RunnerBatchMirror.roll_back_rejected``), and the next diff sends the blocks past that count."""
    scheduler = _scheduler()
    batch = PersistentBatch(max_blocks_per_request=16, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    request = Request("r", list(PROMPT), SamplingParams(temperature=0, max_tokens=20))
    scheduler.add_request(request)

    def run(sampled: list[int]) -> None:
        out = scheduler.schedule()
        batch.update(out)
        batch.append_sampled({"r": sampled})
        if out.requests[0].draft_token_ids:
            batch.drop_rejected_blocks("r")
        scheduler.update_from_output(out, ModelOutput({"r": sampled}))

    run([8])
    run([5, 6, 7, 8, 5])  # all accepted: positions 0..12 known
    run([1])  # the draft of positions 13..16 took a fifth block; every draft rejected
    assert len(request.block_ids) == 4
    assert len(batch.block_ids("r")) == scheduler._batch_mirror._num_blocks_sent["r"] == 4
    run([2])  # the next diff sends exactly the blocks the runner lacks
    assert batch.block_ids("r") == request.block_ids


def test_a_stop_token_inside_the_accepted_run_truncates_it_and_frees_everything() -> None:
    scheduler = _scheduler()
    request = _prefilled(scheduler, stop_token_ids=[6])
    outputs = scheduler.update_from_output(scheduler.schedule(), ModelOutput({"r": [5, 6, 7, 8, 5]}))
    assert outputs[0].new_token_ids == [5, 6] and request.is_finished
    assert scheduler.kv.num_free_blocks() == 16


def test_a_run_truncated_by_a_stop_token_keeps_the_logprobs_of_its_kept_tokens_only() -> None:
    scheduler = _scheduler()
    _prefilled(scheduler, stop_token_ids=[6], logprobs=0)
    accepted = [5, 6, 7, 8, 5]
    logprobs = [TokenLogprobs([t], [-0.5 * (i + 1)], [1]) for i, t in enumerate(accepted)]
    (output,) = scheduler.update_from_output(scheduler.schedule(), ModelOutput({"r": accepted}, {"r": logprobs}))
    assert output.new_token_ids == [5, 6]
    assert output.logprobs == logprobs[:2]


def test_no_draft_past_max_tokens_or_the_budget() -> None:
    scheduler = _scheduler()
    _prefilled(scheduler)
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=3)
    assert scheduler.schedule().requests[0].draft_token_ids == (5, 6)
    scheduler = _scheduler()
    request = Request("r", list(PROMPT), SamplingParams(temperature=0, max_tokens=3))
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), ModelOutput({"r": [8]}))
    assert scheduler.schedule().requests[0].draft_token_ids == (5,)  # 2 outputs left: 1 draft + 1


def test_a_draft_that_does_not_fit_in_memory_is_dropped_rather_than_preempting() -> None:
    scheduler = _scheduler(num_blocks=3)
    _prefilled(scheduler, max_tokens=5)  # 8 tokens in 2 blocks
    scheduler.kv.pool.allocate(1)  # another holder takes the last free block
    out = scheduler.schedule()
    assert out.requests[0].draft_token_ids == () and out.requests[0].num_tokens == 1
    assert scheduler.num_preemptions == 0


def test_draft_slots_are_scheduled_as_query_tokens_and_rolled_back_like_drafts() -> None:
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, kv, SpeculationPolicy(SpeculativeConfig("draft", 4, model="draft-model")))
    request = _prefilled(scheduler)
    out = scheduler.schedule()
    (row,) = out.requests
    assert row.draft_token_ids == (DRAFT_SLOT,) * 4 and (row.start_pos, row.num_tokens) == (7, 5)
    assert len(request.block_ids) == 3  # positions 0..11: the slots hold the draft model's KV and tokens
    scheduler.update_from_output(out, ModelOutput({"r": [3, 9]}))  # the runner's draft: one accepted, then 9
    assert request.output_token_ids == [8, 3, 9] and request.num_computed_tokens == 9
    assert scheduler.speculation.stats()["spec_decode_num_accepted_tokens"] == 1
    scheduler.kv.check_integrity([request])


def test_a_finished_request_leaves_no_speculation_state_and_its_accepted_blocks_in_the_tree() -> None:
    """Its last step accepted drafts that filled a block: the block joins the prefix tree before the request's
    blocks are freed (a follow-up turn finds it), and the acceptance rate kept per request goes with it."""
    scheduler = _scheduler()
    request = _prefilled(scheduler, max_tokens=6)  # outputs: 8, then up to 5 more in one verified step
    out = scheduler.schedule()
    assert out.requests[0].draft_token_ids == (5, 6, 7, 8)
    scheduler.update_from_output(out, ModelOutput({"r": [5, 6, 7, 8, 9]}))  # every draft accepted, then 9
    assert request.is_finished and request.output_token_ids == [8, 5, 6, 7, 8, 9]
    assert not scheduler.speculation._acceptance
    assert scheduler.kv.prefix_cache.num_nodes == 3  # positions 0..11 computed: the third block is the drafts'
    scheduler.kv.check_integrity([])


def test_drafts_leave_each_running_decode_and_the_queue_head_a_token_of_a_small_budget() -> None:
    """Drafts sized from the whole budget, in admission order, took all of it: requests behind got nothing for
    many steps."""
    kv = KVCacheManager(64, BLOCK_SIZE, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_batched_tokens=8, max_model_len=64, max_num_seqs=3)
    scheduler = Scheduler(config, kv, SpeculationPolicy(SpeculativeConfig("ngram", 7, 1, 3)))
    for rid in ("a", "b"):
        scheduler.add_request(Request(rid, list(PROMPT), SamplingParams(temperature=0, max_tokens=30)))
        out = scheduler.schedule()
        scheduler.update_from_output(out, ModelOutput({r.request_id: [8] for r in out.requests if r.sample}))
    scheduler.add_request(Request("c", list(PROMPT), SamplingParams(temperature=0, max_tokens=30)))
    out = scheduler.schedule()
    rows = {row.request_id: row for row in out.requests}
    assert set(rows) == {"a", "b", "c"}, rows  # b decodes and c starts, beside a's draft
    assert out.num_tokens <= 8 and rows["a"].draft_token_ids
