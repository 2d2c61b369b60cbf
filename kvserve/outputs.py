"""What the user gets back: RequestOutput holding one CompletionOutput per sample.

A finished request's token ids and logprobs are lists; an unfinished request's (what a stream's outputs carry
before its last) are read-only views of the engine's lists at the time of the output (``ListPrefix``: they
index, slice, iterate and compare as lists), since copying them at every step makes a long generation's host
work quadratic."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:
    import torch


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Logprob:
    """One token's log probability (under the model's raw distribution, or what the engine's ``logprobs_mode``
    names) and its rank (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position: token id -> Logprob, holding the chosen token and the top-k alternatives.
PositionLogprobs = dict[int, Logprob]


class TokenLogprobs(NamedTuple):
    """Log probabilities at one position as the sampler computes them (the output processor turns them into
    ``PositionLogprobs``): ``token_ids[0]`` is the chosen (sampled or prompt) token, the rest are the top-k
    alternatives in descending order; ``ranks[i]`` is 1 for the most likely token."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: Sequence[PositionLogprobs] | None = None

    def finished(self) -> bool:
        """Whether this sample is done (a method, as vLLM's ``CompletionOutput.finished()``; ``RequestOutput``'s
        ``finished`` is a field)."""
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the chosen tokens' logprobs, as vLLM's (to rank ``n`` samples); None unless ``logprobs`` was
        asked for."""
        if self.logprobs is None:
            return None
        return sum(position[token].logprob for token, position in zip(self.token_ids, self.logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: Sequence[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when the engine first scheduled it


@dataclass
class PoolingOutput:
    """A pooling request's hidden states (``PoolingParams``): float32, on the CPU; [hidden] for ``embed``,
    [prompt tokens, hidden] for ``token_embed``."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """What a pooling request returns (vLLM's): finished once, its prompt run; ``outputs`` None if it was
    aborted before."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s answer for one prompt (vLLM's): its vector as a list."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s answer for one pair (vLLM's): the cosine similarity of the two texts' embeddings."""

    request_id: str  # the pair's: its two embedding requests' ids joined by "_", as vLLM names it
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the two texts' tokens, one after the other
    finished: bool = True
