"""POST /v1/chat/completions: messages (and tools) rendered with the model's chat template -> an assistant
reply: content, or tool calls read out of the output by ``tools``' parser; with ``--reasoning-parser``, the
thinking split off first (``reasoning_parsers``), the calls read out of the answer alone."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Literal

from kvserve.engine.detokenizer import token_bytes
from kvserve.outputs import PositionLogprobs, RequestOutput
from kvserve.lora_request import LoRARequest
from kvserve.sampling_params import InvalidParameter, StructuredOutputsParams
from kvserve.server.errors import bad_request
from kvserve.server.chat_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)
from kvserve.server.protocol import Usage
from kvserve.server.reasoning_parsers import (
    THINK_END,
    THINK_START,
    ReasoningDelta,
    ReasoningSplitter,
    split_reasoning,
    starts_in_reasoning,
)
from kvserve.server.request_log import RequestLog
from kvserve.server.logprobs import entry_spelling, json_logprob, text_positions, top_entries
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
from kvserve.server.tool_parsers import OutputParser, ParsedDelta, ToolCallDelta, parse_tool_calls
from kvserve.server.tools import (
    DeclaredTools,
    checked_schema,
    dropped_by_decoding,
    needs_special_tokens,
    output_parser,
    tool_call_format,
    tool_constraint,
)

if TYPE_CHECKING:
    from kvserve.engine.async_engine import Admission, AsyncEngine


async def render_chat(engine: AsyncEngine, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                      **options: Any) -> dict[str, Any]:
    """The conversation (and tools) as a token-id prompt, rendered on the inputs thread (``options``:
    ``AsyncEngine.render_chat``'s); a conversation the template cannot render (e.g. roles that do not alternate)
    is a 400 about the messages, an option it cannot render with a 400 naming that option."""
    conversation = [m.model_dump(exclude_none=True) for m in messages]
    try:
        return await engine.render_chat(conversation, tools, **options)
    except InvalidParameter as e:  # an option: continue_final_message, chat_template_kwargs
        raise bad_request(e) from e
    except ValueError as e:
        raise bad_request(ValueError(f"messages: {e}"), param="messages") from e


class ChatServer(GenerationHandler):
    """Turns one ChatCompletionRequest into an engine request and its outputs into OpenAI's answer."""

    id_prefix = "chatcmpl"
    body: ChatCompletionRequest

    def __init__(self, engine: AsyncEngine, body: ChatCompletionRequest, model_name: str,
                 tool_call_parser: str = "auto", client_request_id: str | None = None,
                 admission: Admission | None = None, request_log: RequestLog = RequestLog(),
                 reasoning_parser: str | None = None, lora_request: LoRARequest | None = None) -> None:
        super().__init__(engine, body, model_name, client_request_id, admission, request_log, lora_request)
        self.tool_choice = body.effective_tool_choice
        self.tool_format = tool_call_format(tool_call_parser, engine.engine.input_processor.chat_template(body.tools))
        self.reasoning_parser = reasoning_parser
        if (self.tool_choice == "auto" and needs_special_tokens(self.tool_format, self.tokenizer)
                or reasoning_parser and any(dropped_by_decoding(self.tokenizer, t) for t in (THINK_START, THINK_END))):
            self.params = dataclasses.replace(self.params, skip_special_tokens=False)
        self._parsers: dict[int, OutputParser | None] = {}
        self._declared: DeclaredTools | None = None
        self._in_reasoning = False  # whether the output starts in the thinking (known once rendered)
        self._splitters: dict[int, ReasoningSplitter] = {}

    async def start(self) -> AsyncIterator[list[RequestOutput]]:
        """Render and queue the conversation (raising APIError 400 for bad input); return the output stream."""
        body = self.body
        if body.tools:
            await self._check_tool_schemas()  # each a 400 naming the tool: DeclaredTools takes them as they are
            self._declared = DeclaredTools(body.tool_dicts or [])
        prompt = await render_chat(self.engine, body.messages, body.tool_dicts, **body.template_options)
        if self.reasoning_parser is not None:
            self._in_reasoning = starts_in_reasoning(self.reasoning_parser, prompt["prompt"],
                                                     body.chat_template_kwargs, body.continue_final_message)
            self._constrain_the_answer_only()
        return await self._generate([prompt])

    def _constrain_the_answer_only(self) -> None:
        """The constraint (``response_format``, a ``guided_*`` field, ``structured_outputs``, or a ``tool_choice``
        that forces calls) of an output that starts in its thinking begins after the thinking's end token, as
        vLLM's does; a 400 naming it where the tokenizer spells ``</think>`` in several tokens (no token to wait
        for). Where the prompt closed the thinking (``enable_thinking: false``), the whole output is held."""
        constraint, field = self.params.structured_outputs, self.body.constraint_field
        if constraint is None or field is None or not self._in_reasoning:
            return
        end = self.tokenizer.encode(THINK_END, add_special_tokens=False)
        if len(end) != 1:
            raise bad_request(InvalidParameter(field, f"{field} with --reasoning-parser {self.reasoning_parser}: "
                                               f"this tokenizer spells {THINK_END} in {len(end)} tokens, and a "
                                               "constraint can only begin after one; turn the thinking off "
                                               "(chat_template_kwargs enable_thinking: false on Qwen3) or send no "
                                               "constraint"))
        gated = dataclasses.replace(constraint, begins_after_token_id=end[0])
        self.params = dataclasses.replace(self.params, structured_outputs=gated)

    async def _check_tool_schemas(self) -> None:
        """A 400 naming the tool, and where in its parameters, whose schema is no JSON schema (as OpenAI checks,
        whatever ``tool_choice`` is) or, among those a grammar will hold the calls to (``tool_choice`` required,
        or a named function: compiled once, cached, the request's own constraint), one it could not hold them to.
        Under ``auto`` and ``none`` the model writes its own calls, as with OpenAI's and vLLM's."""
        tools = self.body.tool_dicts or []
        for i, tool in enumerate(tools):
            try:
                checked_schema(tool["function"].get("parameters") or {})
            except ValueError as e:
                raise bad_request(ValueError(f"tools[{i}].function.parameters: {e}"),
                                  param=f"tools.{i}.function.parameters") from e
        constraint = tool_constraint(tools, self.tool_choice, self.body.parallel_tool_calls)
        if constraint is None:
            return
        try:
            await self.engine.compile_constraint(constraint)
        except ValueError as e:
            error, param = await self._tool_schema_error(tools, e)
            raise bad_request(error, param=param) from e

    async def _tool_schema_error(self, tools: list[dict[str, Any]], error: ValueError) -> tuple[ValueError, str]:
        """The error of the first tool the constraint holds calls to, placed in its parameters (``error`` placed it
        in the array of calls that ``required`` compiles), and the field it names, as the request's validation
        names one (``tools.0.function.parameters``)."""
        named = self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None
        for i, tool in enumerate(tools):
            if named not in (None, tool["function"]["name"]):
                continue
            own = StructuredOutputsParams(json=tool["function"].get("parameters") or {"type": "object"})
            try:
                await self.engine.compile_constraint(own)
            except ValueError as e:
                return ValueError(f"tools[{i}].function.parameters: {e}"), f"tools.{i}.function.parameters"
        return ValueError(f"tools: {error}"), "tools"

    async def respond(self, stream: AsyncIterator[list[RequestOutput]]) -> ChatCompletionResponse:
        (out,) = await last_item(stream)
        # on a worker thread: n = 64 samples of 480 tokens with 20 alternatives each held the event loop 11 s
        return await asyncio.to_thread(self._response, out)

    def _response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for s in out.outputs:
            if self.reasoning_parser is None:
                message, finish_reason = self._message(s.text, str(s.finish_reason), s.stop_reason)
            else:
                split = split_reasoning(s.text, self._in_reasoning)
                message, finish_reason = self._message(split.content, str(s.finish_reason), s.stop_reason)
                message.content = message.content or None
                message.reasoning = self._reasoning(split)
            if self.body.echoed_text:
                message.content = self.body.echoed_text + (message.content or "")
            whole = SampleDelta.whole(s)
            choices.append(ChatChoice(index=s.index, message=message, finish_reason=finish_reason,
                                      stop_reason=s.stop_reason, logprobs=self._logprobs(whole),
                                      token_ids=self.extras.token_ids(whole)))
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model_name, choices=choices,
            usage=Usage.of(*num_tokens_used([out])), prompt_logprobs=self.extras.prompt_logprobs(out),
            prompt_token_ids=self.extras.prompt_token_ids(out),
        )

    async def stream(self, stream: AsyncIterator[list[RequestOutput]]) -> AsyncIterator[str]:
        """Server-sent events: the role first for every choice (and what ``echo`` puts first), then content
        deltas, the finish reason with the last one, usage last if asked, then ``[DONE]``."""
        exclude = None if self.body.include_usage else {"usage"}
        for event in self._opening_events(exclude):
            yield event
        contents = TextEvents(lambda i, text: self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=text))]),
                              exclude)
        cursor = BatchCursor(self.params.n)
        outputs: list[RequestOutput] = []
        async for outputs in stream:
            for index, delta in cursor.advance(outputs):
                if (delta.finish_reason is None and not self.body.logprobs and self._parser(index) is None
                        and self.reasoning_parser is None and not self.extras.vary_by_chunk):
                    yield contents.event(index, delta.text)  # content alone, as a parser-less _delta makes it
                    continue
                message, finish_reason = self._reasoning_delta(index, delta.text, delta.finish_reason,
                                                               delta.stop_reason)
                logprobs = self._logprobs(delta)
                token_ids = self.extras.token_ids(delta)
                if message.content is None and message.tool_calls is None and message.reasoning is None \
                        and finish_reason is None and logprobs is None and not token_ids:
                    continue  # text a parser holds back: nothing to send yet
                choice = ChatChunkChoice(index=index, delta=message, finish_reason=finish_reason,
                                         stop_reason=delta.stop_reason, logprobs=logprobs, token_ids=token_ids)
                yield sse(self._chunk([choice], self.extras.chunk_usage(outputs[0], index)), exclude)
        if self.body.include_usage:
            yield sse(self._chunk([], Usage.of(*num_tokens_used(outputs))))
        yield SSE_DONE

    def _opening_events(self, exclude: set[str] | None) -> list[str]:
        """The role of every choice (with vLLM's extras: the prompt's tokens, the usage before any output), then
        what ``echo`` puts before every reply."""
        (first,) = self.first_outputs
        usage = self.extras.chunk_usage(first, None)
        events = [sse(self._chunk(self._choices(DeltaMessage(role="assistant", content="")), usage,
                                  self.extras.prompt_token_ids(first)), exclude)]
        if self.body.echoed_text:
            events.append(sse(self._chunk(self._choices(DeltaMessage(content=self.body.echoed_text)), usage), exclude))
        return events

    def _choices(self, delta: DeltaMessage) -> list[ChatChunkChoice]:
        return [ChatChunkChoice(index=i, delta=delta) for i in range(self.params.n)]

    def _new_parser(self) -> OutputParser | None:
        """A parser for one sample's output; None when the output is only content."""
        return output_parser(self.tool_choice, self.body.parallel_tool_calls, self.tool_format, self._declared)

    def _parser(self, index: int) -> OutputParser | None:
        if index not in self._parsers:
            self._parsers[index] = self._new_parser()
        return self._parsers[index]

    def _message(self, text: str, finish_reason: str, stop_reason: int | str | None) -> tuple[AssistantMessage, str]:
        """A whole sample's message: its content, or its tool calls and what content they leave."""
        parser = self._new_parser()
        if parser is None:
            return AssistantMessage(content=text), finish_reason
        content, calls = parse_tool_calls(parser, text)
        finished = self._calls_finish(finish_reason, stop_reason)
        if not calls or (parser.num_invalid and finished == "tool_calls"):
            # a call the model finished that is no JSON object is its text, as vLLM's parsers answer: a client
            # must be able to read every call's arguments (a call cut short by max_tokens keeps "length")
            return AssistantMessage(content=content if not calls else text), finish_reason
        tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        return AssistantMessage(content=content or None, tool_calls=tool_calls), finished

    def _reasoning_delta(self, index: int, text: str, finish_reason: str | None,
                         stop_reason: int | str | None) -> tuple[DeltaMessage, str | None]:
        """A streamed piece of choice ``index``, its thinking split off first where a reasoning parser runs."""
        if self.reasoning_parser is None:
            return self._delta(index, text, finish_reason, stop_reason)
        splitter = self._splitters.setdefault(index, ReasoningSplitter(self._in_reasoning))
        split = splitter.feed(text)
        if finish_reason is not None:
            split += splitter.finish()
        message, finish_reason = self._delta(index, split.content, finish_reason, stop_reason)
        message.content = message.content or None
        reasoning = self._reasoning(split)
        if reasoning is not None:
            message.reasoning = reasoning
        return message, finish_reason

    def _reasoning(self, split: ReasoningDelta) -> str | None:
        """The thinking an answer carries: none where it is empty or the request left it out."""
        return split.reasoning or None if self.body.include_reasoning else None

    def _delta(self, index: int, text: str, finish_reason: str | None,
               stop_reason: int | str | None) -> tuple[DeltaMessage, str | None]:
        """A streamed piece of choice ``index``: content, pieces of calls, and the finish reason with the last."""
        parser = self._parser(index)
        if parser is None:
            return DeltaMessage(content=text), finish_reason
        parsed = parser.feed(text)
        if finish_reason is not None:
            parsed.extend(parser.finish())
            if parser.num_calls and not parser.num_invalid:  # a stream cannot take back a broken call's pieces
                finish_reason = self._calls_finish(finish_reason, stop_reason)
        tool_calls = [_delta_call(d) for d in _merged(parsed)] or None
        return DeltaMessage(content=parsed.content or None, tool_calls=tool_calls), finish_reason

    def _calls_finish(self, finish_reason: str, stop_reason: int | str | None) -> str:
        """A sample that ended by itself after calling tools finished for its calls; one cut by max_tokens, a
        stop string or a stop token did not (its last call's arguments may be cut short), and keeps its reason.
        So does a call of the function ``tool_choice`` names, as OpenAI and vLLM answer: "stop"."""
        if isinstance(self.tool_choice, dict):
            return finish_reason
        return "tool_calls" if finish_reason == "stop" and stop_reason is None else finish_reason

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None,
               prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model_name,
                                   choices=choices, usage=usage, prompt_token_ids=prompt_token_ids)

    def _logprobs(self, delta: SampleDelta) -> ChatLogprobs | None:
        if not self.body.logprobs or delta.logprobs is None:
            return None
        k = self.body.top_logprobs or 0
        content = []
        for token_id, position in text_positions(delta, self.params.include_stop_str_in_output):
            chosen = self._top(token_id, position)
            top = [self._top(t, position) for t, _ in top_entries(position, k)]
            content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, position: PositionLogprobs) -> TopLogprob:
        """A token (``token_spelling``), its log probability and its own bytes."""
        token = entry_spelling(token_id, position[token_id], self.tokenizer, self.body.return_tokens_as_token_ids)
        return TopLogprob(token=token, logprob=json_logprob(position[token_id].logprob),
                          bytes=token_bytes(token_id, self.tokenizer))


PieceKind = Literal["reasoning", "content", "call"]


def delta_pieces(message: DeltaMessage) -> Iterator[tuple[PieceKind, str | DeltaToolCall]]:
    """A streamed delta's pieces in the order they were written, for endpoints that tell a message as a sequence
    of parts (Responses' items, Messages' content blocks): thinking, then the rest of a call already open (the
    tail of its arguments, which the parser holds back until the call closes, may come beside the text written
    after it), then text, then new calls."""
    if message.reasoning:
        yield "reasoning", message.reasoning
    calls = message.tool_calls or []
    for call in calls:
        if call.id is None:
            yield "call", call
    if message.content:
        yield "content", message.content
    for call in calls:
        if call.id is not None:
            yield "call", call


def _merged(parsed: ParsedDelta) -> list[ToolCallDelta]:
    """Consecutive pieces of one call joined, so a chunk names each call once."""
    out: list[ToolCallDelta] = []
    for piece in parsed.tool_calls:
        if out and out[-1].index == piece.index and piece.id is None:
            out[-1] = dataclasses.replace(out[-1], arguments=out[-1].arguments + piece.arguments)
        else:
            out.append(piece)
    return out


def _delta_call(piece: ToolCallDelta) -> DeltaToolCall:
    if piece.id is None:
        return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
    return DeltaToolCall(index=piece.index, id=piece.id, type="function",
                         function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))
