"""What vLLM's extra request fields add to an answer, on completions and chat alike: the prompt's and each
choice's token ids (``return_token_ids``), the prompt's logprobs (``prompt_logprobs``) and each streamed chunk's
usage so far (``stream_options.continuous_usage_stats``). Each is None where the request did not ask for it, and
``WithExtras`` then leaves it out of the answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from kvserve.outputs import RequestOutput
from kvserve.server.logprobs import entry_spelling
from kvserve.server.protocol import SamplingRequest, Usage

if TYPE_CHECKING:
    from kvserve.server.streaming import SampleDelta


class PromptLogprob(BaseModel):
    """One token of a prompt position, as vLLM answers ``prompt_logprobs`` (its ``Logprob``)."""

    logprob: float
    rank: int
    decoded_token: str


# a position per prompt token, the first None (nothing predicts it): token id (a JSON key) -> its logprob, the prompt's
# own token first, then the ``prompt_logprobs`` most likely
PromptLogprobs = list[dict[str, PromptLogprob] | None]


@dataclass(frozen=True)
class ResponseExtras:
    """Which extras a request asked for, and each made of the engine's outputs."""

    return_token_ids: bool
    return_prompt_logprobs: bool
    continuous_usage: bool
    tokenizer: Any

    @classmethod
    def of(cls, body: SamplingRequest, tokenizer: Any) -> ResponseExtras:
        return cls(body.return_token_ids, body.prompt_logprobs is not None, body.continuous_usage, tokenizer)

    @property
    def vary_by_chunk(self) -> bool:
        """Whether each streamed chunk carries something of its own (its tokens, its usage) beside its text."""
        return self.return_token_ids or self.continuous_usage

    def prompt_token_ids(self, out: RequestOutput) -> list[int] | None:
        return list(out.prompt_token_ids) if self.return_token_ids else None

    def token_ids(self, delta: SampleDelta) -> list[int] | None:
        """The delta's token ids (a whole answer's: all of them), the EOS or stop token that ended it included."""
        return list(delta.token_ids) if self.return_token_ids else None

    def prompt_logprobs(self, out: RequestOutput) -> PromptLogprobs | None:
        if not self.return_prompt_logprobs or out.prompt_logprobs is None:
            return None
        return [None if position is None else {
            str(token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                         decoded_token=entry_spelling(token_id, lp, self.tokenizer))
            for token_id, lp in position.items()} for position in out.prompt_logprobs]

    def chunk_usage(self, out: RequestOutput, sample_index: int | None) -> Usage | None:
        """A streamed chunk's usage, as vLLM counts it: the prompt's tokens and the tokens of the choice's sample
        ``sample_index`` so far (None: before any, as the role and echo chunks of chat)."""
        if not self.continuous_usage:
            return None
        samples = [] if sample_index is None else [s for s in out.outputs if s.index == sample_index]
        num_tokens = len(samples[0].token_ids) if samples else 0
        return Usage.of(len(out.prompt_token_ids), num_tokens, out.num_cached_tokens)
