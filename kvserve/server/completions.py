"""POST /v1/completions: a prompt (text, token ids, or a batch of either) -> text, streamed or not."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from kvserve.lora_request import LoRARequest
from kvserve.outputs import CompletionOutput, FinishReason, PositionLogprobs, RequestOutput
from kvserve.server.completion_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvserve.server.protocol import Usage
from kvserve.server.request_log import RequestLog
from kvserve.server.logprobs import (
    entry_spelling,
    json_logprob,
    text_positions,
    token_spelling,
    token_text,
    top_entries,
)
from kvserve.server.streaming import (
    GenerationHandler,
    SSE_DONE,
    BatchCursor,
    SampleDelta,
    TextEvents,
    last_item,
    num_tokens_used,
    sse,
)

if TYPE_CHECKING:
    from kvserve.engine.async_engine import Admission, AsyncEngine
    from kvserve.engine.input_processor import PromptInput


def engine_prompts(body: CompletionRequest) -> list[PromptInput]:
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in body.prompts]


class CompletionServer(GenerationHandler):
    """Turns one CompletionRequest into engine requests and their outputs into OpenAI's answer."""

    id_prefix = "cmpl"
    body: CompletionRequest

    def __init__(self, engine: AsyncEngine, body: CompletionRequest, model_name: str,
                 client_request_id: str | None = None, admission: Admission | None = None,
                 request_log: RequestLog = RequestLog(), lora_request: LoRARequest | None = None) -> None:
        super().__init__(engine, body, model_name, client_request_id, admission, request_log, lora_request)
        self._token_offsets: dict[int, int] = {}  # choice index -> the text offset after its tokens sent so far

    async def start(self) -> AsyncIterator[list[RequestOutput]]:
        """Queue the requests (raising APIError 400 for bad input) and return their output stream."""
        stream = await self._generate(engine_prompts(self.body))
        return _prompts_only(stream) if self.body.scores_prompt else stream

    async def respond(self, stream: AsyncIterator[list[RequestOutput]]) -> CompletionResponse:
        outputs = await last_item(stream)
        return await asyncio.to_thread(self._response, outputs)  # as chat's: large answers take a while

    def _response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices = [
            self._choice(i * self.params.n + s.index, out, SampleDelta.whole(s))
            for i, out in enumerate(outputs) for s in out.outputs
        ]
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model_name, choices=choices,
            usage=Usage.of(*num_tokens_used(outputs))
        )

    async def stream(self, stream: AsyncIterator[list[RequestOutput]]) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice that moved, usage last if asked, then ``[DONE]``."""
        cursor = BatchCursor(self.params.n)
        exclude = None if self.body.include_usage else {"usage"}
        outputs: Sequence[RequestOutput] = []
        texts = TextEvents(lambda i, text: self._chunk([CompletionChoice(index=i, text=text)]), exclude)
        async for outputs in stream:
            for index, delta in cursor.advance(outputs):
                if delta.finish_reason is None and self.body.logprobs is None and not (
                        self.body.echo and delta.is_first) and not self.extras.vary_by_chunk:
                    yield texts.event(index, delta.text)  # text alone, as _choice makes it
                    continue
                out = outputs[index // self.params.n]
                choice = self._choice(index, out, delta)
                yield sse(self._chunk([choice], self.extras.chunk_usage(out, index % self.params.n)), exclude)
        if self.body.include_usage:
            yield sse(self._chunk([], Usage.of(*num_tokens_used(outputs))))
        yield SSE_DONE

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model_name,
                                  choices=choices, usage=usage)

    def _choice(self, index: int, out: RequestOutput, delta: SampleDelta) -> CompletionChoice:
        """With echo, the prompt goes before the sample's first text; the prompt's extras (its tokens, its
        logprobs) come with it too."""
        with_prompt = self.body.echo and delta.is_first
        extras = self.extras
        return CompletionChoice(
            index=index, text=self._prompt_text(out) + delta.text if with_prompt else delta.text,
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            logprobs=self._logprobs(index, out, delta, with_prompt), token_ids=extras.token_ids(delta),
            prompt_logprobs=extras.prompt_logprobs(out) if delta.is_first else None,
            prompt_token_ids=extras.prompt_token_ids(out) if delta.is_first else None,
        )

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(
        self, index: int, out: RequestOutput, delta: SampleDelta, with_prompt: bool
    ) -> CompletionLogprobs | None:
        """The choice's token logprobs, each token's ``text_offset`` the summed lengths of the tokens before it,
        each decoded alone, counted on from the choice's last chunk (a stream sends a token before text held back
        for a stop string or an incomplete character, so the text sent is no measure): where it starts in the
        choice's text, but for the pieces of a character, which count one U+FFFD each (as vLLM counts them)."""
        if self.body.logprobs is None or delta.logprobs is None:
            return None
        positions: list[tuple[int, PositionLogprobs | None]] = list(
            text_positions(delta, self.params.include_stop_str_in_output))
        unseen: set[int] = set()
        if with_prompt:
            positions = list(zip(out.prompt_token_ids, out.prompt_logprobs or [])) + positions
            unseen = self._added_bos(out)
        result, self._token_offsets[index] = self._format_logprobs(positions, self._token_offsets.get(index, 0),
                                                                   unseen)
        return result

    def _added_bos(self, out: RequestOutput) -> set[int]:
        """{0} where the tokenizer put a BOS token before a text prompt that the echoed text does not hold."""
        bos = self.tokenizer.bos_token_id
        first = out.prompt_token_ids[:1]
        if out.prompt is None or first != [bos] or out.prompt.startswith(self.tokenizer.decode(first)):
            return set()
        return {0}

    def _format_logprobs(self, positions: list[tuple[int, PositionLogprobs | None]], offset: int,
                         unseen: set[int]) -> tuple[CompletionLogprobs, int]:
        """The entries, their text offsets from ``offset`` (the positions in ``unseen`` take no room in the text),
        and the offset after them. Tokens spelled by their ids (``return_tokens_as_token_ids``) keep the offsets
        of their text, where vLLM's count the spellings' lengths, which are no place in the text."""
        result = CompletionLogprobs()
        k = self.body.logprobs or 0
        as_id = self.body.return_tokens_as_token_ids
        for token_id, position in positions:
            if position is None:  # the first prompt token has no logprob
                token = self.tokenizer.decode([token_id])
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                token = token_text(token_id, position[token_id], self.tokenizer)
                result.token_logprobs.append(json_logprob(position[token_id].logprob))
                # the token itself beside the k most likely, as OpenAI's and vLLM's legacy completions give it;
                # most likely first, so a spelling two tokens share keeps the higher logprob
                top: dict[str, float] = {}
                for t, lp in [*top_entries(position, k), (token_id, position[token_id])]:
                    top.setdefault(entry_spelling(t, lp, self.tokenizer, as_id), json_logprob(lp.logprob))
                result.top_logprobs.append(top)
            result.tokens.append(token_spelling(token_id, token, self.tokenizer, as_id))
            result.text_offset.append(offset)
            offset += 0 if len(result.tokens) - 1 in unseen else len(token)  # the token decoded alone
        return result, offset


async def _prompts_only(stream: AsyncIterator[list[RequestOutput]]) -> AsyncIterator[list[RequestOutput]]:
    """The outputs of a scoring request (``max_tokens`` 0) without the one token each sample drew: their prompts
    alone, finished by length."""
    async for outputs in stream:
        yield [replace(out, outputs=[
            CompletionOutput(s.index, "", [], FinishReason.LENGTH if s.finished() else None, None,
                             [] if s.logprobs is not None else None) for s in out.outputs])
               for out in outputs]
