"""The runner's persistent batch, fed only by step diffs, against inputs built from scratch from the scheduler's
own requests (the truth), over random sequences of admissions, preemptions, resumptions, forks and aborts."""

from __future__ import annotations

import pickle
import zlib

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.kv.groups import KVCacheGroups
from kvserve.kv.manager import KVCacheManager
from kvserve.outputs import FinishReason
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.config import SpeculativeConfig
from kvserve.sched.output import ModelOutput, ScheduledRequest, SchedulerOutput
from kvserve.sched.scheduler import Scheduler
from kvserve.spec.policy import SpeculationPolicy
from kvserve.worker.input_batch import InputBatch, PersistentBatch
from kvserve.worker.staging import PinnedStaging
from tests.sched.sched_fakes import make_request, make_scheduler

CPU = torch.device("cpu")


def sampled_token(request_id: str, num_tokens: int) -> int:
    return 10 + zlib.crc32(f"{request_id}:{num_tokens}".encode()) % 500


def reference_inputs(scheduler: Scheduler, sched_out: SchedulerOutput) -> dict[str, list]:
    """What the step's inputs must be, from the scheduler's full requests (block tables padded with 0)."""
    block_size = scheduler.kv.block_size
    requests = [scheduler.requests[r.request_id] for r in sched_out.requests]
    width = max(len(request.block_ids) for request in requests)
    input_ids, positions, slots, sample_rows = [], [], [], []
    for row, request in zip(sched_out.requests, requests):
        span = range(row.start_pos, row.start_pos + row.num_tokens)
        history = request.prompt_token_ids + request.output_token_ids + list(row.draft_token_ids)
        input_ids += history[span.start : span.stop]
        positions += span
        slots += [request.block_ids[p // block_size] * block_size + p % block_size for p in span]
        if row.sample:  # a speculating row samples at its last token and at each draft token
            sample_rows += range(len(positions) - 1 - len(row.draft_token_ids), len(positions))
    return {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": slots,
        "seq_lens": [r.start_pos + r.num_tokens for r in sched_out.requests],
        "block_tables": [request.block_ids + [0] * (width - len(request.block_ids)) for request in requests],
        "sample_rows": sample_rows,
        "sample_request_ids": [r.request_id for r in sched_out.requests if r.sample],
        "shared_prefix_lens": shared_keys([(request.block_ids, row.start_pos + 1) for row, request
                                           in zip(sched_out.requests, requests) if row.num_tokens == 1], block_size),
    }


def shared_keys(decodes: list[tuple[list[int], int]], block_size: int) -> list[int]:
    """Each decode's (block ids, sequence length) leading keys read from the same blocks as the other decodes
    whose first block is its own, among the blocks complete before each member's own key."""
    lens = []
    for ids, _ in decodes:
        group = [(other, seq_len) for other, seq_len in decodes if other[0] == ids[0]]
        complete = min((seq_len - 1) // block_size for _, seq_len in group)
        common = 0
        while len(group) > 1 and common < complete and len({tuple(g[: common + 1]) for g, _ in group}) == 1:
            common += 1
        lens.append(common * block_size)
    return lens


def actual_inputs(batch: InputBatch) -> dict[str, list]:
    return {
        "input_ids": batch.input_ids.tolist(),
        "positions": batch.positions.tolist(),
        "slot_mapping": batch.attn.slot_mapping.tolist(),
        "seq_lens": batch.attn.seq_lens.tolist(),
        "block_tables": batch.attn.block_tables.tolist(),
        "sample_rows": batch.sample_rows.tolist(),
        "sample_request_ids": batch.sample_request_ids,
        "shared_prefix_lens": batch.attn.shared_prefix_lens.tolist(),
    }


def verified_tokens(row: ScheduledRequest) -> list[int]:
    """A fake verification: a number of the row's drafts that depends on the row alone, then a token."""
    draft = row.draft_token_ids
    num_accepted = zlib.crc32(f"{row.request_id}@{row.start_pos}".encode()) % (len(draft) + 1)
    return [*draft[:num_accepted], sampled_token(row.request_id, row.start_pos + num_accepted + 1)]


def sampling_row(request: Request, drafts: tuple[int, ...]) -> tuple[SamplingParams, list[int]]:
    """A sampling row's params and history: a speculating request's row j has its first j drafts appended."""
    return request.sampling_params, [*request.output_token_ids, *drafts]


def run_step(scheduler: Scheduler, batch: PersistentBatch) -> SchedulerOutput:
    """One step through the persistent batch, checked against the from-scratch inputs."""
    sched_out = scheduler.schedule()
    batch.update(sched_out)
    if not sched_out.is_empty:
        inputs = batch.prepare(sched_out)
        assert actual_inputs(inputs) == reference_inputs(scheduler, sched_out)
        firsts = [table[0] for table in inputs.attn.block_tables.tolist()[: inputs.attn.num_decodes]]
        order = inputs.attn.sharing_order.tolist()  # each sharing group's decodes together
        assert sorted(order) == list(range(len(firsts))) and [firsts[i] for i in order] == sorted(firsts)
        assert [(row.params, list(row.output_token_ids)) for row in inputs.sampling.rows] == [
            sampling_row(scheduler.requests[r.request_id], r.draft_token_ids[:j])
            for r in sched_out.requests if r.sample for j in range(len(r.draft_token_ids) + 1)
        ]
    sampled = {r.request_id: verified_tokens(r) for r in sched_out.requests if r.sample}
    batch.append_sampled(sampled)
    for r in sched_out.requests:
        if r.draft_token_ids:
            batch.drop_rejected_blocks(r.request_id)
    scheduler.update_from_output(sched_out, ModelOutput(sampled))
    for request_id, request in scheduler.requests.items():
        if request_id in batch:
            assert batch.output_token_ids(request_id) == request.output_token_ids
            assert batch.block_ids(request_id) == request.block_ids
    return sched_out


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 12), st.sampled_from([1, 1, 2, 3]), st.booleans()),
        min_size=1, max_size=10,
    ),
    st.integers(8, 40),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_the_persistent_batch_fed_by_diffs_equals_a_batch_built_from_scratch(
    specs: list[tuple[int, int, int, bool]], num_blocks: int, prefix_caching: bool, speculate: bool,
    one_copy: bool, rng
) -> None:
    """``one_copy``: the inputs through the staging buffer CUDA uses (every step reusing it)."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                               max_model_len=48, prefix_caching=prefix_caching)
    if speculate:  # drafts from repeated prompt tokens (the shared prefix) and repeated sampled tokens
        scheduler.speculation = SpeculationPolicy(SpeculativeConfig("ngram", 3, 1, 2))
    batch = PersistentBatch(max_blocks_per_request=12, block_size=4, device=CPU, capacity=2,
                            staging=PinnedStaging(CPU) if one_copy else None)
    pending = [make_request(f"r{i}", p, max_tokens=m, n=n, prefix=[7] * min(p, 8) if shared else [])
               for i, (p, m, n, shared) in enumerate(specs)]
    for _ in range(500):
        if pending and rng.random() < 0.5:
            try:
                scheduler.add_request(pending.pop())
            except ValueError:  # larger than the whole cache: refused, nothing queued
                pass
        if scheduler.requests and rng.random() < 0.1:  # abort a random request, wherever it is
            scheduler.finish_requests([rng.choice(sorted(scheduler.requests))], FinishReason.ABORT)
        if not pending and not scheduler.has_unfinished_requests():
            break
        run_step(scheduler, batch)
    else:
        raise AssertionError("the workload did not finish")
    run_step(scheduler, batch)  # the last diff drops the finished requests
    assert batch.num_requests == 0


def decode_step_bytes(context_len: int) -> int:
    """The pickled size of a decode step of 8 requests with ``context_len``-token prompts."""
    scheduler = make_scheduler(num_blocks=8 * context_len // 16 + 64, block_size=16, max_num_batched_tokens=8192,
                               max_num_seqs=8, max_model_len=context_len + 64)
    batch = PersistentBatch(-(-(context_len + 64) // 16), 16, CPU)
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", context_len, max_tokens=32))
    while any(r.num_computed_tokens < context_len for r in scheduler.requests.values()):
        run_step(scheduler, batch)
    sizes = [len(pickle.dumps(run_step(scheduler, batch))) for _ in range(8)]
    return int(np.median(sizes))


def test_a_steps_size_does_not_grow_with_context_length() -> None:
    assert decode_step_bytes(8000) == decode_step_bytes(512)  # positions of both pickle in two bytes


def test_a_request_scheduled_before_it_was_added_is_a_clear_error() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4, max_tokens=2))
    sched_out = scheduler.schedule()
    batch = PersistentBatch(8, 4, CPU)
    try:
        batch.prepare(sched_out)
    except ValueError as error:
        assert "never added" in str(error)
    else:
        raise AssertionError("prepare ran a request the batch does not hold")


def grouped_reference(scheduler: Scheduler, sched_out: SchedulerOutput) -> list[dict[str, list]]:
    """Per KV cache group, the step's block tables (nulls kept, padded with 0) and slots, from the scheduler."""
    block_size = scheduler.kv.block_size
    requests = [scheduler.requests[r.request_id] for r in sched_out.requests]
    width = max(len(request.block_ids) for request in requests)
    reference = []
    for group in range(scheduler.kv.groups.num_groups):
        tables = [scheduler.kv.tables(request)[group] for request in requests]
        slots = [table[p // block_size] * block_size + p % block_size
                 for row, table in zip(sched_out.requests, tables)
                 for p in range(row.start_pos, row.start_pos + row.num_tokens)]
        reference.append({"block_tables": [t + [0] * (width - len(t)) for t in tables], "slot_mapping": slots})
    return reference


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.sampled_from([1, 1, 2])), min_size=1, max_size=8),
    st.integers(12, 40),
    st.booleans(),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_every_kv_cache_groups_tables_and_slots_follow_the_diffs(specs, num_blocks: int, prefix_caching: bool,
                                                                  one_copy: bool, rng) -> None:
    """Window groups' tables with null entries (and, from prefix hits, requests entering with them);
    ``one_copy``: through the staging buffer CUDA uses."""
    groups = KVCacheGroups.of_layers([5, None, 5])  # three groups of one layer
    scheduler = Scheduler(SchedulerConfig(4, 16, 48), KVCacheManager(num_blocks, 4, prefix_caching, groups=groups))
    batch = PersistentBatch(max_blocks_per_request=12, block_size=4, device=CPU, capacity=2, num_groups=3,
                            staging=PinnedStaging(CPU) if one_copy else None)
    pending = [make_request(f"r{i}", p, max_tokens=m, n=n, prefix=[7] * min(p, 12))
               for i, (p, m, n) in enumerate(specs)]
    while pending or scheduler.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            try:
                scheduler.add_request(pending.pop())
            except ValueError:
                pass
        if scheduler.requests and rng.random() < 0.05:
            scheduler.finish_requests([rng.choice(sorted(scheduler.requests))], FinishReason.ABORT)
        sched_out = scheduler.schedule()
        batch.update(sched_out)
        sampled = {}
        if not sched_out.is_empty:
            attn = batch.prepare(sched_out).attn
            actual = [{"block_tables": a.block_tables.tolist(), "slot_mapping": a.slot_mapping.tolist()}
                      for a in (attn, *attn.groups)]
            assert actual == grouped_reference(scheduler, sched_out)
            sampled = {r.request_id: [sampled_token(r.request_id, r.start_pos)] for r in sched_out.requests if r.sample}
        batch.append_sampled(sampled)
        scheduler.update_from_output(sched_out, ModelOutput(sampled))
        for request_id, request in scheduler.requests.items():
            if request_id in batch:
                assert [batch.block_ids(request_id, g) for g in range(3)] == scheduler.kv.tables(request)
    batch.update(scheduler.schedule())
    assert batch.num_requests == 0
