"""POST /v1/completions: a prompt (text, token ids, or a batch of either) -> text, streamed or not."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Sequence

from kvserve.outputs import PositionLogprobs, RequestOutput
from kvserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from kvserve.server.streaming import (
    GenerationHandler,
    SSE_DONE,
    BatchCursor,
    SampleDelta,
    last_item,
    num_tokens_used,
    sse,
    token_text,
    top_entries,
)

if TYPE_CHECKING:
    from kvserve.engine.input_processor import PromptInput


def engine_prompts(body: CompletionRequest) -> list[PromptInput]:
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in body.prompts]


class CompletionServer(GenerationHandler):
    """Turns one CompletionRequest into engine requests and their outputs into OpenAI's answer."""

    id_prefix = "cmpl"
    body: CompletionRequest

    async def start(self) -> AsyncIterator[list[RequestOutput]]:
        """Queue the requests (raising APIError 400 for bad input) and return their output stream."""
        return await self._generate(engine_prompts(self.body))

    async def respond(self, stream: AsyncIterator[list[RequestOutput]]) -> CompletionResponse:
        outputs = await last_item(stream)
        choices = [
            self._choice(i * self.params.n + s.index, out, SampleDelta(
                s.text, s.token_ids, s.logprobs, str(s.finish_reason), s.stop_reason, text_offset=0, is_first=True))
            for i, out in enumerate(outputs) for s in out.outputs
        ]
        return CompletionResponse(
            id=self.request_id, model=self.model_name, choices=choices, usage=Usage.of(*num_tokens_used(outputs))
        )

    async def stream(self, stream: AsyncIterator[list[RequestOutput]]) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice that moved, usage last if asked, then ``[DONE]``."""
        cursor = BatchCursor(self.params.n)
        exclude = None if self.body.include_usage else {"usage"}
        outputs: Sequence[RequestOutput] = []
        async for outputs in stream:
            for index, delta in cursor.advance(outputs):
                choice = self._choice(index, outputs[index // self.params.n], delta)
                yield sse(self._chunk([choice]), exclude)
        if self.body.include_usage:
            yield sse(self._chunk([], Usage.of(*num_tokens_used(outputs))))
        yield SSE_DONE

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, model=self.model_name, choices=choices, usage=usage)

    def _choice(self, index: int, out: RequestOutput, delta: SampleDelta) -> CompletionChoice:
        """With echo, the prompt goes before the sample's first text, and text offsets count it."""
        text, text_offset = delta.text, delta.text_offset
        with_prompt = self.body.echo and delta.is_first
        if self.body.echo:
            prompt_text = self._prompt_text(out)
            text = prompt_text + text if with_prompt else text
            text_offset += 0 if with_prompt else len(prompt_text)
        return CompletionChoice(
            index=index, text=text, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            logprobs=self._logprobs(out, delta, with_prompt, text_offset),
        )

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(
        self, out: RequestOutput, delta: SampleDelta, with_prompt: bool, text_offset: int
    ) -> CompletionLogprobs | None:
        if self.body.logprobs is None or delta.logprobs is None:
            return None
        positions: list[tuple[int, PositionLogprobs | None]] = list(zip(delta.token_ids, delta.logprobs))
        if with_prompt:
            positions = list(zip(out.prompt_token_ids, out.prompt_logprobs or [])) + positions
        return self._format_logprobs(positions, text_offset)

    def _format_logprobs(self, positions: list[tuple[int, PositionLogprobs | None]], offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        k = self.body.logprobs or 0
        for token_id, position in positions:
            if position is None:  # the first prompt token has no logprob
                token = self.tokenizer.decode([token_id])
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                token = token_text(token_id, position[token_id], self.tokenizer)
                result.token_logprobs.append(position[token_id].logprob)
                result.top_logprobs.append(
                    {token_text(t, lp, self.tokenizer): lp.logprob for t, lp in top_entries(position, k)}
                )
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
        return result
