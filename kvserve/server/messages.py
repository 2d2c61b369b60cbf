"""POST /v1/messages: an Anthropic Messages request served as the chat request it stands for (``ChatServer``: the
chat template, tool calls read by ``tools``' parser, the thinking split off by ``--reasoning-parser``), its answer
told as Anthropic's message object: content blocks (thinking, text, tool_use), or the stream of their events.

A stream is Anthropic's events, each named in an ``event:`` line: ``message_start`` (the message, its content
empty), then for each content block ``content_block_start``, its ``content_block_delta``s (``thinking_delta``,
``text_delta`` or ``input_json_delta``) and ``content_block_stop``; last ``message_delta`` (the stop reason and
the usage) and ``message_stop``. No ``[DONE]``; a failure midway is an ``error`` event (``errors.sse_failure``).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Literal

from kvserve.outputs import RequestOutput
from kvserve.server.chat import ChatServer, delta_pieces
from kvserve.server.chat_protocol import ChatCompletionRequest, DeltaMessage, DeltaToolCall
from kvserve.server.errors import APIError
from kvserve.server.messages_protocol import (
    ContentBlock,
    MessageObject,
    MessagesRequest,
    MessageUsage,
    StopReason,
    TextContent,
    ThinkingContent,
    ToolUseContent,
)
from kvserve.server.streaming import BatchCursor, last_item, num_tokens_used, sse_event

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncEngine

BlockKind = Literal["thinking", "text", "tool_use"]


class MessagesServer(ChatServer):
    """Turns one MessagesRequest (its ``chat_request`` the body) into an engine request and its outputs into
    Anthropic's message or events."""

    id_prefix = "msg"
    id_separator = "_"

    def __init__(self, engine: AsyncEngine, body: ChatCompletionRequest, model_name: str,
                 messages: MessagesRequest, **options: Any) -> None:
        super().__init__(engine, body, model_name, **options)
        self.messages = messages

    async def start(self) -> AsyncIterator[list[RequestOutput]]:
        try:
            return await super().start()
        except APIError as error:
            raise _in_messages_terms(error) from error

    async def respond(self, stream: AsyncIterator[list[RequestOutput]]) -> MessageObject:
        (out,) = await last_item(stream)
        return await asyncio.to_thread(self._whole, out)

    def _whole(self, out: RequestOutput) -> MessageObject:
        """The chat answer's message as content blocks: its thinking, its text, its calls."""
        (choice,) = self._response(out).choices
        message = choice.message
        content: list[ContentBlock] = []
        if message.reasoning:
            content.append(ThinkingContent(thinking=message.reasoning))
        if message.content:
            content.append(TextContent(text=message.content))
        for call in message.tool_calls or []:
            content.append(ToolUseContent(id=call.id, name=call.function.name,
                                          input=_call_input(call.function.arguments)))
        stop_reason, stop_sequence = _stop_reason(str(choice.finish_reason), choice.stop_reason,
                                                  bool(message.tool_calls))
        return self._message_object(content, stop_reason, stop_sequence, out)

    async def stream(self, stream: AsyncIterator[list[RequestOutput]]) -> AsyncIterator[str]:
        events = MessageEvents()
        (first,) = self.first_outputs
        yield events.event("message_start", message=self._message_object([], None, None, first).model_dump())
        cursor = BatchCursor(1)
        outputs: list[RequestOutput] = []
        finish_reason, stop_reason = "stop", None
        async for outputs in stream:
            for index, delta in cursor.advance(outputs):
                message, finished = self._reasoning_delta(index, delta.text, delta.finish_reason, delta.stop_reason)
                if finished is not None:
                    finish_reason, stop_reason = finished, delta.stop_reason
                for event in events.pieces(message):
                    yield event
        for event in events.close():
            yield event
        reason, sequence = _stop_reason(finish_reason, stop_reason, events.num_calls > 0)
        yield events.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                           usage=self._usage(outputs[0]).model_dump())
        yield events.event("message_stop")

    def _message_object(self, content: list[ContentBlock], stop_reason: StopReason | None,
                        stop_sequence: str | None, out: RequestOutput) -> MessageObject:
        return MessageObject(id=self.request_id, model=self.model_name, content=content, stop_reason=stop_reason,
                             stop_sequence=stop_sequence, usage=self._usage(out))

    def _usage(self, out: RequestOutput) -> MessageUsage:
        """``out``'s counts so far, the prompt's split into computed and found in the prefix cache."""
        num_prompt, num_output, num_cached = num_tokens_used([out])
        return MessageUsage(input_tokens=num_prompt - num_cached, output_tokens=num_output,
                            cache_read_input_tokens=num_cached)


def _call_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its ``input``; {} for arguments the output cut short (``max_tokens`` or a stop sequence
    ended it, as ``stop_reason`` says: a call the model finished is a JSON object, or it is text)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _stop_reason(finish_reason: str, stop_reason: int | str | None, has_calls: bool) -> tuple[StopReason, str | None]:
    """Anthropic's stop reason (and the stop sequence met) for a chat answer's finish: cut by ``max_tokens`` (or
    the model's context), at one of ``stop_sequences``, after calls (a named ``tool_choice``'s call finishes
    "stop" on chat, as OpenAI's), else at the end of the model's turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or has_calls and stop_reason is None:
        return "tool_use", None
    return "end_turn", None


def _in_messages_terms(error: APIError) -> APIError:
    """A 400 of the chat machinery about a tool's parameters, told in Anthropic's words: its ``input_schema``."""
    def renamed(text: str) -> str:
        return text.replace(".function.parameters", ".input_schema")

    return APIError(error.status, renamed(error.message), param=error.param and renamed(error.param),
                    headers=error.headers)


class MessageEvents:
    """A message's content block events as its chat deltas come: the open block (its kind and index), the calls."""

    def __init__(self) -> None:
        self.num_blocks = 0  # the blocks closed; the open one's index
        self.num_calls = 0
        self._open: BlockKind | None = None

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\n" + sse_event(json.dumps({"type": kind, **fields}, ensure_ascii=False))

    def pieces(self, message: DeltaMessage) -> Iterator[str]:
        """The events of a piece of the output, in the order ``delta_pieces`` gives its parts."""
        for kind, piece in delta_pieces(message):
            if isinstance(piece, DeltaToolCall):
                yield from self._call(piece)
            elif kind == "reasoning":
                yield from self._text("thinking", piece, {"type": "thinking", "thinking": "", "signature": ""})
            else:
                yield from self._text("text", piece, {"type": "text", "text": ""})

    def close(self) -> Iterator[str]:
        """The open block's end, if one is open."""
        if self._open is not None:
            yield self.event("content_block_stop", index=self.num_blocks)
            self.num_blocks += 1
            self._open = None

    def _text(self, kind: BlockKind, text: str, empty: dict[str, str]) -> Iterator[str]:
        if self._open != kind:
            yield from self._start(kind, empty)
        yield self.event("content_block_delta", index=self.num_blocks, delta={"type": f"{kind}_delta", kind: text})

    def _call(self, piece: DeltaToolCall) -> Iterator[str]:
        """A call's first piece (its id and name) opens its block; each piece's arguments are a delta."""
        if piece.id is not None:
            self.num_calls += 1
            yield from self._start("tool_use", {"type": "tool_use", "id": piece.id,
                                                "name": piece.function.name or "", "input": {}})
        arguments = piece.function.arguments
        if self._open == "tool_use" and arguments:
            yield self.event("content_block_delta", index=self.num_blocks,
                             delta={"type": "input_json_delta", "partial_json": arguments})

    def _start(self, kind: BlockKind, empty: dict[str, Any]) -> Iterator[str]:
        yield from self.close()
        self._open = kind
        yield self.event("content_block_start", index=self.num_blocks, content_block=empty)
