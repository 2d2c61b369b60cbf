"""The bodies of POST /v1/completions: a prompt (text, token ids, or a batch of either) in, text choices out."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, StrictBool, StrictInt, Tag, model_validator

from kvserve.sampling_params import InvalidParameter, SamplingParams
from kvserve.server.protocol import SamplingRequest, Text, TokenIds, Usage, WithExtras
from kvserve.server.response_extras import PromptLogprobs


def _shape(value: Any) -> str:
    """A union member for a value by its shape, so that a value that fits none gets the error of the member it
    was meant for ("prompt.0: Input should be a valid integer" for ``[1.5]``), not the first member's. The tags
    look like type names, which error messages leave out of a field's path."""
    if isinstance(value, list):
        first = value[0] if value else None
        if isinstance(first, list):
            return "list[list[int]]"
        return "list[str]" if isinstance(first, str) else "list[int]"
    return "str"


Prompt = Annotated[
    Union[Annotated[Text, Tag("str")], Annotated[list[Text], Tag("list[str]")], Annotated[TokenIds, Tag("list[int]")],
          Annotated[list[TokenIds], Tag("list[list[int]]")]],
    Discriminator(_shape),
]


MAX_BATCH_SAMPLES = 2048  # prompts x n of one /v1/completions request (OpenAI takes up to 2,048 prompts)


class CompletionRequest(SamplingRequest):
    # an echo's prompt logprobs come from the request itself, which a beam search never is
    BEAM_SEARCH_REFUSES = (*SamplingRequest.BEAM_SEARCH_REFUSES, "echo")

    prompt: Prompt
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise InvalidParameter("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter("best_of", "best_of other than n is not supported (every sample is returned)")
        for name in ("tools", "tool_choice"):
            if getattr(self, name) is not None:
                raise InvalidParameter(name, f"{name} is only supported on /v1/chat/completions")
        if self.prompt == [] or any(p == [] or p == "" for p in self.prompts):
            raise InvalidParameter("prompt", "prompt must not be empty")
        # all queued at once, ahead of every later request (an n out of its range is refused as such)
        if 1 <= self.n <= SamplingParams.MAX_N and len(self.prompts) * self.n > MAX_BATCH_SAMPLES:
            raise InvalidParameter("prompt", f"prompt: a batch of {len(self.prompts):,} prompts x n={self.n} is "
                                   f"{len(self.prompts) * self.n:,} samples; at most {MAX_BATCH_SAMPLES:,} a request")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one text or token-id list per entry."""
        return prompt_batch(self.prompt)

    @property
    def scores_prompt(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt back with its logprobs and no completion (how evaluation
        harnesses score a text)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """The engine's SamplingParams; ``defaults`` (the model's) fill the fields left out."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:  # as vLLM: the echoed prompt's entries come with the answer's
            prompt_logprobs = self.logprobs
        # scoring runs one step, whose token the answer leaves out: the prompt's logprobs come with the first
        max_tokens = 1 if self.scores_prompt else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, defaults, prompt_logprobs=prompt_logprobs)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(WithExtras):
    EXTRAS = ("token_ids", "prompt_logprobs", "prompt_token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extras, as the request asks: its sample's tokens (a stream's: the chunk's), the prompt's logprobs and
    # the prompt's tokens (a stream's: in the choice's first chunk)
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


def prompt_batch(prompt: Prompt) -> list[str | list[int]]:
    """A request's batch of prompts (OpenAI's ``prompt`` or ``input``): one text or token-id list per entry."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]
