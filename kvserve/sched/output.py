"""The messages that cross the scheduler / model runner boundary, in one module.

Only Python ints, floats and lists travel back from the device to the scheduler.

``SchedulerOutput`` is a diff of the runner's batch: ``NewRequestData`` names a request in full once;
``ScheduledRequest`` is then its chunk and its new blocks (every KV cache group's, and the leading entries that
became ``NULL_BLOCK``), beside the finished and preempted ids. ``KVTransferPlan`` lists the step's block moves
(offloads, copies, swap-outs, loads and swap-ins, in that order, and why). ``ModelOutput`` and ``EngineOutput``
come back, log probabilities as ``outputs.TokenLogprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvserve.outputs import FinishReason, TokenLogprobs
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class NewRequestData:
    """A request entering the runner's batch, named in full once: at admission, when it resumes after a
    preemption (with its outputs so far, to recompute), or when it is forked from an n > 1 request (before its
    parent's first draw: the sample's sampling state starts from its own first row). From then on each step
    names only what changed (``ScheduledRequest``), so a step's size does not grow with context length."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # the block table as it stands when the request enters the batch; with KV cache groups (``kv/groups.py``)
    # every group's, group after group, each as long (a window group's freed entries ``NULL_BLOCK``)
    block_ids: list[int]
    sample_index: int = 0
    eos_token_ids: frozenset[int] = frozenset()  # masked by the sampler while min_tokens is not reached
    lora_id: int = 0  # the LoRA adapter its tokens run with (``Request.lora_id``); 0: the base model
    pooling_params: PoolingParams | None = None  # a pooling request's (``Request.pooling_params``)


class ScheduledRequest(NamedTuple):
    """One request's share of a step, as a diff against what the runner already holds (a NamedTuple, not a
    frozen dataclass: a step builds one per running request, and a tuple is several times cheaper to make).

    The step runs the request's tokens at positions ``start_pos .. start_pos + num_tokens - 1`` (a prefill
    chunk, or the one token sampled last step); ``start_pos`` equals the request's ``num_computed_tokens``
    before the step. ``new_block_ids`` are appended to its block table (empty on the step a request enters
    the batch: its ``NewRequestData`` has the whole table). ``sample`` is False for a non-final prefill
    chunk; ``prompt_logprobs`` asks for the logprobs of the prompt tokens this chunk predicts.

    With KV cache groups (``kv/groups.py``), ``new_block_ids`` holds every group's new blocks, group after group,
    the same number each, and ``num_null_blocks``, when not empty, how many leading entries of each group's
    table are now ``NULL_BLOCK`` (blocks a window group freed: no query of the step or after reads them).

    A speculating decode runs its last sampled token then ``draft_token_ids`` (``num_tokens`` = 1 + drafts),
    and the runner returns the accepted drafts plus one token of its own. Afterwards both sides keep only
    the blocks that the request's known tokens need (``ceil(num_tokens / block_size)``): blocks taken only
    for rejected drafts are freed by the scheduler and dropped from the runner's table.
    """

    request_id: str
    start_pos: int
    num_tokens: int
    new_block_ids: tuple[int, ...] = ()
    sample: bool = True
    prompt_logprobs: bool = False
    draft_token_ids: tuple[int, ...] = ()
    num_null_blocks: tuple[int, ...] = ()

    @property
    def is_decode(self) -> bool:
        """A decode row: the token sampled last step (and drafts after it), not a chunk of the prompt."""
        return self.start_pos > 0 and self.num_tokens == 1 + len(self.draft_token_ids)


@dataclass(frozen=True)
class KVTransferPlan:
    """Block moves to apply before the forward pass, in this order:

    1. ``offloads`` copy (block_id, host row) from the device pool to the KV tiers' host slab: blocks evicted
       (or computed, to be written to the disk) since the last step, which a copy, a load or this step's tokens
       may overwrite;
    2. ``copies`` are (src_block, dst_block) pairs, e.g. the copy-on-write of a partly filled block when a
       request forks into n samples;
    3. ``swap_outs`` copy (block_id, host row) the KV of requests preempted by swap, after ``copies`` (a sample
       swapped out the step after its fork reads its copied block) and before anything that writes blocks
       they freed: loads, swap-ins, this step's tokens. (A copy never targets such a block: copies are
       planned by forks, which take blocks before this step's preemptions or in steps that preempt none.)
    4. ``loads`` copy (host row, block_id) from the host tier into fresh blocks (a prefix hit on an
       offloaded block), and ``swap_ins`` (host row, block_id) a resumed request's swapped-out KV.

    Rows, not content keys: the KV manager picked them when it planned (``kv/tiers.py``), so the runner only
    copies bytes between its KV tensors and the host slab."""

    copies: tuple[tuple[int, int], ...] = ()
    offloads: tuple[tuple[int, int], ...] = ()
    loads: tuple[tuple[int, int], ...] = ()
    swap_outs: tuple[tuple[int, int], ...] = ()
    swap_ins: tuple[tuple[int, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.copies or self.offloads or self.loads or self.swap_outs or self.swap_ins)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step, as a diff of the runner's batch. The runner applies it in this order: drop
    ``finished_request_ids`` (all per-request state) and ``preempted_request_ids`` (batch rows only; a
    preempted request comes back in ``new_requests``), add ``new_requests``, apply ``kv_transfers``, then
    run ``requests``: one-token rows first, then prefill chunks (the attention backend relies on it)."""

    requests: list[ScheduledRequest]
    num_tokens: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    kv_transfers: KVTransferPlan = field(default_factory=KVTransferPlan)
    finished_request_ids: frozenset[str] = frozenset()  # finished since the last step
    preempted_request_ids: frozenset[str] = frozenset()  # left the batch since the last step, to come back

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class ModelOutput:
    """What the runner computed: ``sampled_token_ids[rid]`` holds the tokens appended to request rid (which
    the runner has already appended to its own copy of the history). Logprobs are per sampled token, and
    per predicted prompt token. ``pooled[rid]``: a pooling request's hidden states, pooled, once its prompt
    has run (float32, on the CPU)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class EngineOutput:
    """Per request per step, from the scheduler to the frontend: the new tokens and, once, how it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    pooled: torch.Tensor | None = None  # a pooling request's result (``ModelOutput.pooled``), as it finishes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
