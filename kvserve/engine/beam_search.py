"""Beam search above the engine, as vLLM v1 runs it: each step, every live beam is a request of one token whose
prompt is the beam's tokens so far, asking for the ``2 * beam_width`` most likely next tokens (``logprobs``).
Every beam extended by each of them is a candidate; a candidate ending in EOS is complete, and the best
``beam_width`` of the others (by cumulative logprob) live on. After ``max_tokens`` steps (or when no beam is
left) the best ``beam_width`` of the complete and live sequences, by cumulative logprob over length **
``length_penalty``, are the answer.

The engine is driven only through its public interface (requests added, stepped, aborted): the prefix cache
shares the KV of every beam's prompt with its parent's and siblings' (a step recomputes at most the partial last
block of each beam), so a step costs about one decode token per beam, plus that block. ``LLM.beam_search`` runs
a ``BeamBatch`` on the engine's step loop; the server's ``beam_search_async`` on the async engine's ``generate``.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Sequence

from kvserve.outputs import CompletionOutput, FinishReason, PositionLogprobs, RequestOutput
from kvserve.sampling_params import BeamSearchParams, InvalidParameter, SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.input_processor import ProcessedPrompt, PromptInput


@dataclass
class BeamSearchSequence:
    """One sequence of a beam search (vLLM's shape): ``tokens`` hold the prompt's too, ``logprobs`` one position
    per output token (the candidates it was chosen among), ``text`` is filled in for the answer."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]


def step_params(params: BeamSearchParams, num_logprobs: int = 0) -> SamplingParams:
    """The params of each beam's one-token request: the candidates' logprobs (``num_logprobs`` if more: what an
    answer's logprobs show; -1, the whole vocabulary), drawn at the search's temperature."""
    logprobs = -1 if num_logprobs == -1 else max(2 * params.beam_width, num_logprobs)
    return SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=logprobs)


class BeamSearch:
    """The search of one prompt."""

    def __init__(self, prompt: ProcessedPrompt, params: BeamSearchParams, eos_token_ids: Collection[int]) -> None:
        self.prompt = prompt
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.live = [BeamSearchSequence(list(prompt.prompt_token_ids), [])]
        self.completed: list[BeamSearchSequence] = []
        self.num_cached_tokens = 0  # of the prompt itself, as its first step found it
        self.aborted = False

    def step_prompts(self) -> list[PromptInput]:
        """The prompts of this step's requests, one per live beam."""
        salt = {"cache_salt": self.prompt.cache_salt} if self.prompt.cache_salt is not None else {}
        return [{"prompt_token_ids": beam.tokens, **salt} for beam in self.live]

    def advance(self, outputs: Sequence[RequestOutput], first_step: bool) -> None:
        """Extend every live beam by its candidates (one output per beam, in order) and keep the best."""
        width = self.params.beam_width
        candidates: list[BeamSearchSequence] = []
        for beam, out in zip(self.live, outputs):
            sample = out.outputs[0]
            if first_step:
                self.num_cached_tokens = out.num_cached_tokens
            if sample.finish_reason is FinishReason.ABORT or not sample.token_ids or not sample.logprobs:
                self.aborted = True  # the engine aborted it (shut down): the search ends with what it has
                continue
            position, drawn = sample.logprobs[0], sample.token_ids[0]
            for token_id, logprob in position.items():
                if logprob.rank > 2 * width and token_id != drawn:
                    continue  # shown in the answer's logprobs, but no candidate
                candidates.append(self._extended(beam, token_id, logprob.logprob, position))
        self.completed += [c for c in candidates if c.finish_reason is FinishReason.STOP]
        # a completed sequence below the best beam_width completed ones can never be among the answer's
        self.completed = self._best(self.completed)
        self.live = [] if self.aborted else self._best([c for c in candidates if c.finish_reason is None])

    def _extended(self, beam: BeamSearchSequence, token_id: int, logprob: float,
                  position: PositionLogprobs) -> BeamSearchSequence:
        ends = token_id in self.eos_token_ids and not self.params.ignore_eos
        return BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [position], beam.cum_logprob + logprob,
                                  finish_reason=FinishReason.STOP if ends else None)

    def _best(self, sequences: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
        return sorted(sequences, key=self.score, reverse=True)[:self.params.beam_width]

    def score(self, sequence: BeamSearchSequence) -> float:
        """vLLM's (after transformers'): the cumulative logprob over the length, prompt included and an ending EOS
        not (even one ``ignore_eos`` kept going, as vLLM counts), to the power ``length_penalty``."""
        length = len(sequence.tokens) - (sequence.tokens[-1] in self.eos_token_ids)
        return sequence.cum_logprob / length ** self.params.length_penalty

    def best(self) -> list[BeamSearchSequence]:
        """The answer: the best ``beam_width`` complete or live sequences, best first; the live ones finish by
        length (or abort)."""
        reason = FinishReason.ABORT if self.aborted else FinishReason.LENGTH
        for beam in self.live:
            beam.finish_reason = reason
        return self._best(self.completed + self.live)

    def output_tokens(self, sequence: BeamSearchSequence, with_eos: bool) -> list[int]:
        """The sequence's tokens after the prompt; an ending EOS only ``with_eos``."""
        tokens = sequence.tokens[len(self.prompt.prompt_token_ids):]
        return tokens if with_eos or sequence.finish_reason is not FinishReason.STOP else tokens[:-1]


class BeamBatch:
    """The searches of several prompts, stepped together: each step one batch of one-token requests, a request
    per live beam of every prompt. ValueError naming ``max_tokens`` where a prompt leaves it no room."""

    def __init__(self, prompts: Sequence[ProcessedPrompt], params: BeamSearchParams, eos_token_ids: Collection[int],
                 max_model_len: int, num_logprobs: int = 0) -> None:
        assert params.max_tokens is not None  # BeamSearchParams requires it
        for prompt in prompts:
            num_prompt_tokens = len(prompt.prompt_token_ids)
            if num_prompt_tokens + params.max_tokens > max_model_len:
                raise InvalidParameter("max_tokens", f"prompt ({num_prompt_tokens} tokens) + max_tokens "
                                       f"({params.max_tokens}) = {num_prompt_tokens + params.max_tokens} is over "
                                       f"max_model_len={max_model_len}")
        self.params = params
        self.step_params = step_params(params, num_logprobs)
        self.searches = [BeamSearch(prompt, params, eos_token_ids) for prompt in prompts]
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return self.num_steps >= self.params.max_tokens or not any(search.live for search in self.searches)

    def step_prompts(self) -> list[PromptInput]:
        return [prompt for search in self.searches for prompt in search.step_prompts()]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Take this step's outputs (one per prompt of ``step_prompts``, in order)."""
        start = 0
        for search in self.searches:
            num_live = len(search.live)
            search.advance(outputs[start:start + num_live], first_step=self.num_steps == 0)
            start += num_live
        self.num_steps += 1

    def outputs(self, tokenizer: Any) -> list[BeamSearchOutput]:
        """``LLM.beam_search``'s answer: each sequence's text is its tokens' decoded, prompt included, as vLLM's
        (the ending EOS only with ``include_stop_str_in_output``)."""
        results = []
        for search in self.searches:
            sequences = search.best()
            for sequence in sequences:
                tokens = sequence.tokens
                if sequence.finish_reason is FinishReason.STOP and not self.params.include_stop_str_in_output:
                    tokens = tokens[:-1]
                sequence.text = tokenizer.decode(tokens)
            results.append(BeamSearchOutput(sequences))
        return results

    def request_outputs(self, request_ids: Sequence[str], tokenizer: Any,
                        skip_special_tokens: bool = True) -> list[RequestOutput]:
        """The server's answer, one finished RequestOutput per prompt, a sample per sequence (best first), as
        ``generate`` shapes them: the token ids hold an ending EOS, its logprob entry too, the text does not
        (unless ``include_stop_str_in_output``)."""
        with_eos = self.params.include_stop_str_in_output
        return [
            RequestOutput(
                request_id, search.prompt.prompt, list(search.prompt.prompt_token_ids),
                [CompletionOutput(i, tokenizer.decode(search.output_tokens(s, with_eos),
                                                      skip_special_tokens=skip_special_tokens),
                                  search.output_tokens(s, with_eos=True), s.finish_reason, None, s.logprobs)
                 for i, s in enumerate(search.best())],
                finished=True, num_cached_tokens=search.num_cached_tokens,
            )
            for request_id, search in zip(request_ids, self.searches)
        ]


async def beam_search_async(engine: AsyncEngine, batch: BeamBatch, request_id: str, priority: int = 0) -> None:
    """Run ``batch`` to its end on the async engine, each step's requests through ``generate_many`` (never
    blocking the event loop); cancelled (a client gone), the step's requests are aborted and nothing is left."""
    for step in itertools.count():
        if batch.done:
            return
        prompts = batch.step_prompts()
        ids = [f"{request_id}-beam{step}-{i}" for i in range(len(prompts))]
        stream = engine.generate_many(prompts, batch.step_params, ids, final_only=True, priority=priority)
        outputs: list[RequestOutput] = []
        async with contextlib.aclosing(stream):
            async for outputs in stream:
                pass
        batch.advance(outputs)
