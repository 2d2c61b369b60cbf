"""POST /v1/chat/completions: messages rendered with the model's chat template -> an assistant reply."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

import jinja2

from kvserve.outputs import PositionLogprobs, RequestOutput
from kvserve.server.errors import bad_request
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kvserve.server.streaming import (
    GenerationHandler,
    SSE_DONE,
    BatchCursor,
    last_item,
    num_tokens_used,
    sse,
    start_generation,
    token_text,
    top_entries,
)

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncEngine


async def render_chat(engine: AsyncEngine, messages: list[ChatMessage], add_generation_prompt: bool) -> dict:
    """The conversation as a token-id prompt, rendered on the engine thread (which owns the tokenizer);
    a template that rejects the conversation (e.g. roles that do not alternate) is a 400."""
    conversation = [m.template_dict() for m in messages]
    try:
        return await engine.call(
            lambda e: e.input_processor.apply_chat_template(conversation, add_generation_prompt)
        )
    except (ValueError, jinja2.TemplateError) as e:
        raise bad_request(ValueError(f"messages: {e}"), param="messages") from e


class ChatServer(GenerationHandler):
    """Turns one ChatCompletionRequest into an engine request and its outputs into OpenAI's answer."""

    id_prefix = "chatcmpl"
    body: ChatCompletionRequest

    async def start(self) -> AsyncIterator[list[RequestOutput]]:
        """Render and queue the conversation (raising APIError 400 for bad input); return the output stream."""
        prompt = await render_chat(self.engine, self.body.messages, self.body.add_generation_prompt)
        return await start_generation(self.engine, [prompt], self.params, self.request_id)

    async def respond(self, stream: AsyncIterator[list[RequestOutput]]) -> ChatCompletionResponse:
        (out,) = await last_item(stream)
        choices = [
            ChatChoice(
                index=s.index, message=AssistantMessage(content=s.text), finish_reason=str(s.finish_reason),
                stop_reason=s.stop_reason, logprobs=self._logprobs(s.token_ids, s.logprobs),
            )
            for s in out.outputs
        ]
        return ChatCompletionResponse(
            id=self.request_id, model=self.model_name, choices=choices, usage=Usage.of(*num_tokens_used([out]))
        )

    async def stream(self, stream: AsyncIterator[list[RequestOutput]]) -> AsyncIterator[str]:
        """Server-sent events: the role first for every choice, then content deltas, the finish reason with the
        last one, usage last if asked, then ``[DONE]``."""
        exclude = None if self.body.include_usage else {"usage"}
        roles = [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(self.params.n)
        ]
        yield sse(self._chunk(roles), exclude)
        cursor = BatchCursor(self.params.n)
        outputs: list[RequestOutput] = []
        async for outputs in stream:
            for index, delta in cursor.advance(outputs):
                choice = ChatChunkChoice(
                    index=index, delta=DeltaMessage(content=delta.text), finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason, logprobs=self._logprobs(delta.token_ids, delta.logprobs),
                )
                yield sse(self._chunk([choice]), exclude)
        if self.body.include_usage:
            yield sse(self._chunk([], Usage.of(*num_tokens_used(outputs))))
        yield SSE_DONE

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model_name, choices=choices, usage=usage)

    def _logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs] | None) -> ChatLogprobs | None:
        if not self.body.logprobs or logprobs is None:
            return None
        k = self.body.top_logprobs or 0
        content = []
        for token_id, position in zip(token_ids, logprobs):
            chosen = self._top(token_id, position)
            top = [self._top(t, position) for t, _ in top_entries(position, k)]
            content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, position: PositionLogprobs) -> TopLogprob:
        token = token_text(token_id, position[token_id], self.tokenizer)
        return TopLogprob(token=token, logprob=position[token_id].logprob, bytes=list(token.encode("utf-8")))
