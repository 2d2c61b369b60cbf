"""POST /v1/responses: a Responses request served as the chat request it stands for (``ChatServer``: the chat
template, tool calls read by ``tools``' parser, the thinking split off by ``--reasoning-parser``), its answer told
as OpenAI's response object: output items (reasoning, message, function calls), or the stream of their events.

A stream is OpenAI's semantic events, each numbered (``sequence_number``): ``response.created`` and
``response.in_progress``, then for each output item ``response.output_item.added``, its content part's
``added``, text deltas (``output_text`` / ``reasoning_text``) or ``function_call_arguments`` deltas, their
``done``, ``response.output_item.done``; last ``response.completed``, or ``response.incomplete`` where
``max_output_tokens`` cut the output (as OpenAI ends it; vLLM's last event is always ``response.completed``), or
``response.failed`` where the engine failed midway (its ``error`` says why; its output what was written, an open
item closed ``incomplete``, no item where nothing was).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Literal

from kvserve.outputs import RequestOutput
from kvserve.server.chat import ChatServer, delta_pieces
from kvserve.server.chat_protocol import ChatCompletionRequest, DeltaMessage, DeltaToolCall
from kvserve.server.errors import APIError
from kvserve.server.reasoning_parsers import THINK_END
from kvserve.server.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)
from kvserve.server.streaming import BatchCursor, failure_message, last_item, num_tokens_used, sse_event

if TYPE_CHECKING:
    from kvserve.engine.async_engine import AsyncEngine

ItemKind = Literal["reasoning", "message", "function_call"]


def _item_id(kind: ItemKind) -> str:
    prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesServer(ChatServer):
    """Turns one ResponsesRequest (its ``chat_request`` the body) into an engine request and its outputs into
    OpenAI's response object or events."""

    id_prefix = "resp"
    id_separator = "_"

    def __init__(self, engine: AsyncEngine, body: ChatCompletionRequest, model_name: str,
                 responses: ResponsesRequest, **options: Any) -> None:
        super().__init__(engine, body, model_name, **options)
        self.responses = responses

    async def start(self) -> AsyncIterator[list[RequestOutput]]:
        try:
            return await super().start()
        except APIError as error:
            raise _in_responses_terms(error) from error

    async def respond(self, stream: AsyncIterator[list[RequestOutput]]) -> ResponseObject:
        (out,) = await last_item(stream)
        return await asyncio.to_thread(self._whole, out)

    def _whole(self, out: RequestOutput) -> ResponseObject:
        """The chat answer's message as output items: its thinking, its text, its calls."""
        (choice,) = self._response(out).choices
        message = choice.message
        items: list[OutputItem] = []
        if message.reasoning:
            items.append(_reasoning(_item_id("reasoning"), message.reasoning, "completed"))
        if message.content:
            items.append(_message(_item_id("message"), message.content, "completed"))
        for call in message.tool_calls or []:
            items.append(OutputFunctionCall(id=_item_id("function_call"), call_id=call.id, name=call.function.name,
                                            arguments=call.function.arguments, status="completed"))
        if not items:  # an empty answer is an empty message, so that a client finds the reply it reads
            items.append(_message(_item_id("message"), "", "completed"))
        status: ResponseStatus = "incomplete" if choice.finish_reason == "length" else "completed"
        if status == "incomplete":
            items[-1].status = "incomplete"
        return self._response_object(status, items, out)

    async def stream(self, stream: AsyncIterator[list[RequestOutput]]) -> AsyncIterator[str]:
        events = ResponseEvents()
        for kind in ("response.created", "response.in_progress"):
            yield events.event(kind, response=self._response_object("in_progress", [], None).model_dump())
        cursor = BatchCursor(1)
        outputs: list[RequestOutput] = []
        finish_reason: str | None = None
        try:
            async for outputs in stream:
                for index, delta in cursor.advance(outputs):
                    message, finished = self._reasoning_delta(index, delta.text, delta.finish_reason,
                                                              delta.stop_reason)
                    finish_reason = finished or finish_reason
                    for event in events.pieces(message):
                        yield event
        except Exception as error:  # the engine failed midway: OpenAI's last event then, with what was written
            message = failure_message(error, self.client_request_id)
            for event in events.close_open("incomplete"):
                yield event
            failed = self._response_object("failed", events.items, None)
            failed.error = ResponseError(message=message)
            yield events.event("response.failed", response=failed.model_dump())
            return
        status: ResponseStatus = "incomplete" if finish_reason == "length" else "completed"
        for event in events.finish(status):
            yield event
        final = self._response_object(status, events.items, outputs[0])
        yield events.event(f"response.{status}", response=final.model_dump())

    def _response_object(self, status: ResponseStatus, output: list[OutputItem],
                         out: RequestOutput | None) -> ResponseObject:
        """The response: the request's settings stated back, ``output``, and the usage once ``out`` is done."""
        request = self.responses
        return ResponseObject(
            id=self.request_id, created_at=self.created, status=status, model=self.model_name, output=output,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            parallel_tool_calls=request.parallel_tool_calls, temperature=self.params.temperature,
            top_p=self.params.top_p, text=request.text_echo, tool_choice=request.tool_choice_echo,
            tools=[tool.model_dump() for tool in request.tools or []], metadata=request.metadata or {},
            user=request.user, usage=None if out is None else self._usage(out))

    def _usage(self, out: RequestOutput) -> ResponseUsage:
        num_prompt, num_output, num_cached = num_tokens_used([out])
        return ResponseUsage(input_tokens=num_prompt, output_tokens=num_output, total_tokens=num_prompt + num_output,
                             input_tokens_details=InputTokensDetails(cached_tokens=num_cached),
                             output_tokens_details=OutputTokensDetails(
                                 reasoning_tokens=self._num_reasoning_tokens(out.outputs[0].token_ids)))

    def _num_reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of the output's first tokens spell its thinking, up to its end tag (all of them where the
        thinking never ends): the shortest prefix whose text holds the tag, found by bisection (a prefix's text
        holds it once a shorter one does)."""
        if self.reasoning_parser is None or not self._in_reasoning:
            return 0
        skip = self.params.skip_special_tokens
        low, high = 0, len(token_ids)
        if THINK_END not in self.tokenizer.decode(token_ids, skip_special_tokens=skip):
            return high
        while low < high:
            middle = (low + high) // 2
            if THINK_END in self.tokenizer.decode(token_ids[:middle], skip_special_tokens=skip):
                high = middle
            else:
                low = middle + 1
        return low


def _message(item_id: str, text: str, status: ItemStatus) -> OutputMessage:
    return OutputMessage(id=item_id, status=status, content=[OutputText(text=text)])


def _reasoning(item_id: str, text: str, status: ItemStatus) -> OutputReasoning:
    return OutputReasoning(id=item_id, status=status, content=[ReasoningText(text=text)])


def _in_responses_terms(error: APIError) -> APIError:
    """A 400 of the chat machinery about a field, told in the Responses request's words: the messages are its
    input, a tool's parameters sit at the tool's top level."""
    def renamed(text: str) -> str:
        text = text.replace(".function.parameters", ".parameters")
        return "input" + text[len("messages"):] if text.startswith("messages") else text

    return APIError(error.status, renamed(error.message), param=error.param and renamed(error.param),
                    headers=error.headers)


@dataclass
class _OpenItem:
    """The output item a stream is writing: its kind, id, place, what it has so far (text or arguments)."""

    kind: ItemKind
    id: str
    output_index: int
    text: str = ""
    call_id: str = ""
    name: str = ""

    def done(self, status: ItemStatus) -> OutputItem:
        if self.kind == "reasoning":
            return _reasoning(self.id, self.text, status)
        if self.kind == "message":
            return _message(self.id, self.text, status)
        return OutputFunctionCall(id=self.id, call_id=self.call_id, name=self.name, arguments=self.text,
                                  status=status)


# each text item's content part as it opens, and its delta and done events
_PARTS = {"reasoning": ({"type": "reasoning_text", "text": ""}, "response.reasoning_text"),
          "message": (OutputText(text="").model_dump(), "response.output_text")}


class ResponseEvents:
    """A response's events, numbered as they are written, and the output items: the open one, those done."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self._open: _OpenItem | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n" + sse_event(json.dumps(data, ensure_ascii=False))

    def pieces(self, message: DeltaMessage) -> Iterator[str]:
        """The events of a piece of the output, in the order ``delta_pieces`` gives its parts."""
        for kind, piece in delta_pieces(message):
            if isinstance(piece, DeltaToolCall):
                yield from self._call(piece)
            else:
                yield from self._text("reasoning" if kind == "reasoning" else "message", piece)

    def finish(self, status: ResponseStatus) -> Iterator[str]:
        """The last item closed (``incomplete`` where the output was cut); an empty message where there was none."""
        if self._open is None and not self.items:
            yield from self._start("message")
        yield from self._close("incomplete" if status == "incomplete" else "completed")

    def close_open(self, status: ItemStatus) -> Iterator[str]:
        """The open item closed, if one is (a failed response's output is what was written: none, or that)."""
        yield from self._close(status)

    def _text(self, kind: ItemKind, text: str) -> Iterator[str]:
        if self._open is None or self._open.kind != kind:
            yield from self._close("completed")
            yield from self._start(kind)
        item = self._open
        assert item is not None
        item.text += text
        extra = {"logprobs": []} if kind == "message" else {}
        yield self.event(f"{_PARTS[kind][1]}.delta", item_id=item.id, output_index=item.output_index,
                         content_index=0, delta=text, **extra)

    def _call(self, piece: DeltaToolCall) -> Iterator[str]:
        """A call's first piece (its id and name) opens its item; each piece's arguments are a delta."""
        if piece.id is not None:
            yield from self._close("completed")
            yield from self._start("function_call", call_id=piece.id, name=piece.function.name or "")
        item = self._open
        arguments = piece.function.arguments
        if item is None or item.kind != "function_call" or not arguments:
            return
        item.text += arguments
        yield self.event("response.function_call_arguments.delta", item_id=item.id, output_index=item.output_index,
                         delta=arguments)

    def _start(self, kind: ItemKind, call_id: str = "", name: str = "") -> Iterator[str]:
        item = self._open = _OpenItem(kind, _item_id(kind), len(self.items), call_id=call_id, name=name)
        shown = item.done("in_progress").model_dump()
        if kind != "function_call":
            shown["content"] = []
        yield self.event("response.output_item.added", output_index=item.output_index, item=shown)
        if kind != "function_call":
            yield self.event("response.content_part.added", item_id=item.id, output_index=item.output_index,
                             content_index=0, part=_PARTS[kind][0])

    def _close(self, status: ItemStatus) -> Iterator[str]:
        item, self._open = self._open, None
        if item is None:
            return
        done = item.done(status)
        where = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "function_call":
            yield self.event("response.function_call_arguments.done", **where, arguments=item.text)
        else:
            part = done.content[0].model_dump()  # type: ignore[union-attr]
            extra = {"logprobs": []} if item.kind == "message" else {}
            yield self.event(f"{_PARTS[item.kind][1]}.done", **where, content_index=0, text=item.text, **extra)
            yield self.event("response.content_part.done", **where, content_index=0, part=part)
        self.items.append(done)
        yield self.event("response.output_item.done", output_index=item.output_index, item=done.model_dump())
