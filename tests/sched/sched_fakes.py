"""A model-free runner for scheduler tests (as vLLM's scheduler tests feed a fake model output).

``FakeRunner`` keeps a fake paged KV cache that stores token ids instead of vectors, and its own copy of each
request built from the step diffs alone (as the real runner's persistent batch is). Every step it applies the
diff and the planned block copies, checks that each row's block table holds the request's exact history (what
attention would read), writes the row's tokens (draft tokens too), and samples a deterministic token per
(request, output index), keeping a speculating row's draft tokens up to the first that differs from it (as
the real sampler's verification does) and dropping the blocks of rejected ones from its table; after the step
its copies must equal the scheduler's requests.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvserve.config import SchedulerConfig, SpeculativeConfig
from kvserve.kv.block_keys import KeyedBlock
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.disk_tier import BlockFormat
from kvserve.kv.storage import KVCacheStorage
from kvserve.kv.tiers import TieredStore
from kvserve.request import SAMPLE_ID_SEPARATOR, Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.sched.output import (
    EngineOutput,
    KVTransferPlan,
    ModelOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from kvserve.sched.scheduler import Scheduler
from kvserve.spec.policy import SpeculationPolicy
from kvserve.worker.kv_transfers import HostCopies

EOS = 2
FIRST_ORDINARY_TOKEN = 10  # ids below this are reserved for EOS / stop-token tests


def default_token(request_id: str, output_index: int) -> int:
    """A token that depends only on the sample and its output index, never on batching or preemption."""
    return FIRST_ORDINARY_TOKEN + zlib.crc32(f"{request_id}:{output_index}".encode()) % 1000


def looping_token(request_id: str, output_index: int) -> int:
    """Outputs that loop with a period of 2 to 5 tokens, one in five replaced by another token: drafts from
    the request's own outputs are often right and sometimes wrong."""
    if zlib.crc32(f"{request_id}/{output_index}".encode()) % 5 == 0:
        return default_token(request_id, output_index)
    key = zlib.crc32(request_id.encode())
    return FIRST_ORDINARY_TOKEN + key % 500 + output_index % (2 + key % 4)


TokenFn = Callable[[str, int], int]


@dataclass
class _Mirror:
    """What the fake runner knows of a request: only what the step diffs told it, plus what it sampled."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    wants_logprobs: bool

    @property
    def history(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


EMPTY_SLOT = -1  # a fake KV slot never written, as a tier stores it


def group_kv(group: int, token_id: int) -> int:
    """KV cache group ``group``'s fake KV of a token: each group's its own, so that a block loaded back into the
    wrong group's table is caught."""
    return group * 10**6 + token_id


class FakeKVBytes:
    """The fake cache's blocks as the KV tiers move them (``KVCacheStorage.read_blocks`` / ``write_blocks``):
    each block one row of int32 token ids, so that what a tier brings back is checked like any other KV."""

    def __init__(self, kv: list[list[int | None]]) -> None:
        self.kv = kv

    def read_blocks(self, block_ids: list[int], out: torch.Tensor, rows: list[int]) -> None:
        for block_id, row in zip(block_ids, rows):
            slots = [EMPTY_SLOT if t is None else t for t in self.kv[block_id]]
            out[row] = torch.tensor(slots, dtype=torch.int32).view(torch.uint8)

    def write_blocks(self, block_ids: list[int], src: torch.Tensor, rows: list[int]) -> None:
        for block_id, row in zip(block_ids, rows):
            self.kv[block_id] = [None if t == EMPTY_SLOT else t for t in src[row].view(torch.int32).tolist()]


def fake_tiers(block_size: int, host_blocks: int, disk_dir: str | None = None, kv_layout: str = "") -> TieredStore:
    """Real KV tiers over fake blocks of int32 token ids (of KV cache groups laid out as ``kv_layout`` says)."""
    block_format = BlockFormat("fake-model", "int32", block_size, 4 * block_size, kv_layout)
    return TieredStore(block_format, host_blocks * block_format.bytes_per_block, host_is_tier=True,
                       disk_dir=disk_dir)


@dataclass
class TransferCounts:
    """Blocks a fake runner moved through the KV tiers, and fork copies it applied, since start."""

    num_loads: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_copies: int = 0


def apply_kv_transfers(kv: list[list[int | None]], tiers: TieredStore | None, transfers: KVTransferPlan,
                       counts: TransferCounts) -> None:
    """A plan's moves over a fake cache, as the real runner applies them (``HostCopies`` over the tiers' host slab,
    in its order: offloads, copies, swap-outs, loads, swap-ins), the offloads' disk writes started once they are
    copied, as the engine wires it."""
    if transfers.offloads or transfers.loads or transfers.swap_outs or transfers.swap_ins:
        assert tiers is not None, "a tier transfer without tiers"
    blocks = FakeKVBytes(kv)
    host = HostCopies(tiers.host_slab, tiers.publish_offloads) if tiers is not None else None
    if transfers.offloads:
        host.offload(blocks, transfers.offloads)
    for src, dst in transfers.copies:
        kv[dst] = list(kv[src])
    counts.num_copies += len(transfers.copies)
    if transfers.swap_outs:
        host.swap_out(blocks, transfers.swap_outs)
    counts.num_swapped_out += len(transfers.swap_outs)
    if transfers.loads:
        host.load(blocks, transfers.loads)
    counts.num_loads += len(transfers.loads)
    if transfers.swap_ins:
        host.swap_in(blocks, transfers.swap_ins)
    counts.num_swapped_in += len(transfers.swap_ins)


def offload_now(tiers: TieredStore, kv: KVCacheStorage | FakeKVBytes, blocks: Sequence[tuple[int, KeyedBlock]]) -> None:
    """Offload ``blocks`` ((block_id, content)) as one plan taken, applied by the runner, and its disk writes
    started."""
    HostCopies(tiers.host_slab, tiers.publish_offloads).offload(kv, tiers.reserve_offload_rows(blocks))


def load_now(tiers: TieredStore, kv: KVCacheStorage | FakeKVBytes, loads: Sequence[tuple[bytes, int]]) -> None:
    """Load pinned host blocks ((content key, block_id)) as one plan taken and applied by the runner."""
    HostCopies(tiers.host_slab).load(kv, tiers.take_load_rows(loads))


class FakeRunner:
    def __init__(
        self, num_blocks: int, block_size: int, token_fn: TokenFn = default_token,
        ref_count: Callable[[int], int] | None = None, tiers: TieredStore | None = None,
    ) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.token_fn = token_fn
        self.ref_count = ref_count  # given: a block is never written while another request holds it
        self.tiers = tiers
        self.moved = TransferCounts()
        self.requests: dict[str, _Mirror] = {}  # the runner's batch, rebuilt from the diffs alone
        self.num_tokens_written = 0

    def execute(self, sched_out: SchedulerOutput) -> ModelOutput:
        for request_id in sched_out.finished_request_ids | sched_out.preempted_request_ids:
            self.requests.pop(request_id, None)
        for new in sched_out.new_requests:
            assert new.request_id not in self.requests, f"{new.request_id} added twice"
            self.requests[new.request_id] = _Mirror(
                list(new.prompt_token_ids), list(new.output_token_ids), list(new.block_ids),
                new.sampling_params.logprobs is not None,
            )
        apply_kv_transfers(self.kv, self.tiers, sched_out.kv_transfers, self.moved)
        out = ModelOutput({}, {}, {})
        for row in sched_out.requests:
            mirror = self.requests[row.request_id]
            mirror.block_ids.extend(row.new_block_ids)
            self._check_history_and_write(row, mirror)
            if row.prompt_logprobs:
                out.prompt_logprobs[row.request_id] = _prompt_logprobs(row, mirror.prompt_token_ids)
            if row.sample:
                self._sample(row, mirror, out)
        return out

    def check_mirrors(self, scheduler: Scheduler) -> None:
        """The diffs kept the runner's copy of every request in its batch equal to the scheduler's."""
        for request_id, mirror in self.requests.items():
            request = scheduler.requests.get(request_id)
            if request is None:  # finished since the last step: the next diff drops it
                continue
            assert request.status is RequestStatus.RUNNING, f"{request_id} is in the runner's batch but not running"
            assert mirror.output_token_ids == request.output_token_ids, request_id
            assert mirror.block_ids == request.block_ids, request_id

    def _check_history_and_write(self, row: ScheduledRequest, mirror: _Mirror) -> None:
        history = mirror.history + list(row.draft_token_ids)
        end = row.start_pos + row.num_tokens
        assert end == len(history) if row.draft_token_ids else end <= len(history), \
            f"{row.request_id}: runs tokens the runner lacks, or a draft after the wrong token"
        assert len(mirror.block_ids) * self.block_size >= end, "block table too short"
        for pos in range(row.start_pos):
            assert self._slot(mirror, pos) == history[pos], f"{row.request_id}: stale KV at position {pos}"
        for pos in range(row.start_pos, end):
            block, offset = divmod(pos, self.block_size)
            block_id = mirror.block_ids[block]
            if self.ref_count is not None:  # 0 only when a test aborts the request between schedule and execute
                assert self.ref_count(block_id) <= 1, f"{row.request_id} writes block {block_id}, which is shared"
            self.kv[block_id][offset] = history[pos]
        self.num_tokens_written += row.num_tokens

    def _slot(self, mirror: _Mirror, pos: int) -> int | None:
        block, offset = divmod(pos, self.block_size)
        return self.kv[mirror.block_ids[block]][offset]

    def _sample(self, row: ScheduledRequest, mirror: _Mirror, out: ModelOutput) -> None:
        """The request's token at its next output index; for a speculating row, one more for each draft token
        while they agree, then only the blocks its known tokens need (as the real runner keeps)."""
        first_index = row.start_pos + row.num_tokens - len(row.draft_token_ids) - len(mirror.prompt_token_ids)
        token_ids = [self.token_fn(row.request_id, first_index)]
        for draft_token in row.draft_token_ids:
            if draft_token != token_ids[-1]:
                break
            token_ids.append(self.token_fn(row.request_id, first_index + len(token_ids)))
        mirror.output_token_ids.extend(token_ids)
        if row.draft_token_ids:
            del mirror.block_ids[-(-len(mirror.history) // self.block_size):]
        out.sampled_token_ids[row.request_id] = token_ids
        if mirror.wants_logprobs:
            index = int(row.request_id.partition(SAMPLE_ID_SEPARATOR)[2] or 0)
            out.logprobs[row.request_id] = [TokenLogprobs([t], [-1.0 - index], [1]) for t in token_ids]


def _prompt_logprobs(row: ScheduledRequest, prompt_token_ids: list[int]) -> list[TokenLogprobs]:
    """Like the real runner: position p of the chunk predicts prompt token p + 1; logprob encodes p + 1."""
    last = min(row.start_pos + row.num_tokens, len(prompt_token_ids) - 1)
    return [TokenLogprobs([prompt_token_ids[p + 1]], [-float(p + 1)], [1]) for p in range(row.start_pos, last)]


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 32, max_num_seqs: int = 8,
    max_model_len: int = 256, prefix_caching: bool = False, policy: str = "fcfs", lpm_aging_steps: int = 64,
    tiers: TieredStore | None = None, speculative: SpeculativeConfig | None = None,
    preemption_mode: str = "recompute", max_loras: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs, max_num_batched_tokens, max_model_len, scheduling_policy=policy, lpm_aging_steps=lpm_aging_steps,
        preemption_mode=preemption_mode, max_loras=max_loras,
    )
    speculation = SpeculationPolicy(speculative) if speculative is not None else None
    return Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching, tiers), speculation)


def make_request(
    request_id: str, num_prompt: int, eos: frozenset[int] = frozenset({EOS}), prefix: list[int] = (), **params
) -> Request:
    """A request whose prompt is ``prefix`` followed by tokens unique to its id, ``num_prompt`` in all."""
    params.setdefault("ignore_eos", True)
    num_own = num_prompt - len(prefix)
    own = [FIRST_ORDINARY_TOKEN + (zlib.crc32(f"{request_id}/{i}".encode()) % 500) for i in range(num_own)]
    return Request(request_id, list(prefix) + own, SamplingParams(**params), eos_token_ids=eos)


def shared_prefix(group: int, num_tokens: int) -> list[int]:
    return [FIRST_ORDINARY_TOKEN + (zlib.crc32(f"group{group}/{i}".encode()) % 500) for i in range(num_tokens)]


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineOutput]]:
    """One engine step, checking the invariants that must hold for every step."""
    sched_out = scheduler.schedule()
    check_step(scheduler, sched_out)
    outputs = scheduler.update_from_output(sched_out, runner.execute(sched_out))
    scheduler.kv.check_integrity(scheduler.requests.values())
    runner.check_mirrors(scheduler)
    return sched_out, outputs


def check_step(scheduler: Scheduler, sched_out: SchedulerOutput) -> None:
    config = scheduler.config
    lengths = [r.num_tokens for r in sched_out.requests]
    assert sched_out.num_tokens == sum(lengths) <= config.max_num_batched_tokens
    assert len(sched_out.requests) <= config.max_num_seqs
    assert len(scheduler.running) <= config.max_num_seqs, "forked samples took the running set past max_num_seqs"
    assert len({r.request_id for r in sched_out.requests}) == len(sched_out.requests)
    assert all(n >= 1 for n in lengths)
    assert lengths == sorted(lengths, key=lambda n: n > 1), f"one-token rows must come first: {lengths}"
    waiting = list(scheduler.waiting)
    assert scheduler.num_waiting == len(waiting) and not set(waiting) & set(scheduler.running)
    assert set(waiting) | set(scheduler.running) == set(scheduler.requests.values()), "a request in no queue"
    if config.scheduling_policy == "priority":  # the waiting queue in rank order, its head the first to admit
        ranks = [(r.priority, r.arrival_time) for r in waiting]
        assert ranks == sorted(ranks), f"out of rank order: {ranks}"
    else:  # requests never admitted in arrival order, behind or among those preempted (at the front as they were)
        arrivals = [r.arrival_time for r in waiting if r.status is RequestStatus.WAITING]
        assert arrivals == sorted(arrivals), "requests never admitted out of arrival order"
    scheduler.kv.check_integrity(scheduler.requests.values())


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000
) -> dict[str, list[EngineOutput]]:
    """Step until nothing is left (bounded: a deadlock fails the test); returns outputs by request id."""
    outputs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        _, step_outputs = step(scheduler, runner)
        for out in step_outputs:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"not finished after {max_steps} steps: a livelock or deadlock")


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def runner_for(scheduler: Scheduler, token_fn: TokenFn = default_token) -> FakeRunner:
    return FakeRunner(scheduler.kv.num_blocks_total, scheduler.kv.block_size, token_fn)


def expected_tokens(request_id: str, num_tokens: int) -> list[int]:
    return [default_token(request_id, k) for k in range(num_tokens)]


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    assert scheduler.kv.num_free_blocks() == scheduler.kv.num_blocks_total
    assert not scheduler.running and not scheduler.waiting and not scheduler.requests
