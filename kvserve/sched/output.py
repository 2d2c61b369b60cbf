"""The messages that cross the scheduler / model runner boundary, in one module.

Only Python ints, floats and lists travel back from the device to the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from kvserve.outputs import FinishReason
from kvserve.sampling_params import SamplingParams


class TokenLogprobs(NamedTuple):
    """Log probabilities at one position: ``token_ids[0]`` is the chosen (sampled or prompt) token, the rest
    are the top-k alternatives in descending order; ``ranks[i]`` is 1 for the most likely token."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    ``token_ids`` are the tokens to run now (a prefill chunk, or the one token sampled last step), at
    positions ``start_pos .. start_pos + len(token_ids) - 1``; ``start_pos`` equals the request's
    ``num_computed_tokens`` before the step. ``block_ids`` is the full block table. ``sample`` is False for a
    non-final prefill chunk. ``num_samples > 1`` only on the step that completes the prompt of a request with
    n > 1: the runner then draws that many first tokens from the one distribution (sample 0 for the request
    itself, the rest for its forks). ``prompt_token_ids`` and ``output_token_ids`` are read-only views of the
    request's history, for penalties.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    sample_index: int = 0
    num_samples: int = 1
    prompt_logprobs: bool = False  # return logprobs of the prompt tokens predicted inside this chunk
    eos_token_ids: frozenset[int] = frozenset()  # masked by the sampler while min_tokens is not reached

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class KVTransferPlan:
    """Block moves to apply before the forward pass: ``copies`` are (src_block, dst_block) pairs, e.g. the
    copy-on-write of a partly filled block when a request forks into n samples."""

    copies: tuple[tuple[int, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.copies)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: decodes come first in ``requests``, then prefill chunks (the attention backend relies on it)."""

    requests: list[ScheduledRequest]
    num_tokens: int
    kv_transfers: KVTransferPlan = field(default_factory=KVTransferPlan)
    finished_request_ids: frozenset[str] = frozenset()  # finished since the last step: drop per-request state

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True)
class ModelOutput:
    """What the runner computed. ``sampled_token_ids[rid]`` holds the token appended to request rid (empty
    list for non-final prefill chunks); for a row with ``num_samples > 1`` the fork tokens of samples
    1..n-1 are in ``fork_token_ids[rid]``. Logprobs are per sampled token, and per predicted prompt token."""

    sampled_token_ids: dict[str, list[int]]
    fork_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    fork_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
