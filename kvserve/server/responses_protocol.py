"""The bodies of POST /v1/responses (OpenAI's Responses API): the request, which renders as the chat request it
stands for (``ResponsesRequest.chat_request``: its input items as chat messages, its tools and text format in chat's
shapes), and the response object with its output items.

What kvserve does not implement is refused by name: a field it does not know (``extra="forbid"``), a built-in
tool, a part or item that is not text, and ``store: true``, ``previous_response_id``, ``background``, ``include``
and ``truncation: "auto"``: nothing is stored, so every request carries its whole conversation.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    Tag,
    field_validator,
    model_validator,
)

from kvserve.sampling_params import InvalidParameter
from kvserve.server.chat_protocol import (
    ChatCompletionRequest,
    ChatTool,
    FunctionDefinition,
    StandInChatRequest,
    known_tool_choice,
)
from kvserve.server.protocol import JSONSchemaFormat, RequestBody, ResponseFormat, Text, json_kind, only_types

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputText(RequestBody):
    type: Literal["input_text"]
    text: Text


class OutputTextPart(RequestBody):
    """An earlier answer's text, sent back as input (its annotations and logprobs are what kvserve sent: none)."""

    type: Literal["output_text"]
    text: Text
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


ContentPart = Annotated[Union[InputText, OutputTextPart], Field(discriminator="type")]
MessageContent = Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[ContentPart], Tag("list")]],
                           Discriminator(json_kind)]
CallOutput = Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[InputText], Tag("list")]],
                       Discriminator(json_kind)]


class MessageItem(RequestBody):
    """A message; ``id`` and ``status`` where it is an earlier output item sent back."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: MessageContent
    id: str | None = None
    status: ItemStatus | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        return only_types(content, ("input_text", "output_text"), "part")

    def chat_message(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else [
            {"type": "text", "text": part.text} for part in self.content]
        return {"role": self.role, "content": content}


class FunctionCallItem(RequestBody):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(RequestBody):
    """What a call returned: text, or (OpenAI's newer form) a list of text parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: CallOutput
    id: str | None = None
    status: ItemStatus | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_parts_only(cls, output: Any) -> Any:
        return only_types(output, ("input_text",), "part")


class ReasoningItem(RequestBody):
    """An earlier answer's thinking sent back (the OpenAI Agents SDK sends every output item back): its
    ``reasoning_text`` parts are the ``reasoning`` of the assistant message its turn's next message or call makes
    (as a chat message's), which the chat template renders or drops (Qwen3's keeps it only after the last user
    message). A summary (OpenAI's own items) is not the thinking: not rendered."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    status: ItemStatus | None = None

    @property
    def text(self) -> str:
        return "\n".join(part["text"] for part in self.content or []
                         if isinstance(part, dict) and part.get("type") == "reasoning_text"
                         and isinstance(part.get("text"), str))


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# tagged type[...]: the error handler leaves such tags out of the place an error names (input.0.content)
InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("type[message]")], Annotated[FunctionCallItem, Tag("type[function_call]")],
          Annotated[FunctionCallOutputItem, Tag("type[function_call_output]")],
          Annotated[ReasoningItem, Tag("type[reasoning]")]],
    Discriminator(lambda v: f"type[{v.get('type', 'message') if isinstance(v, dict) else v.type}]"),
]
Input = Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[InputItem], Field(min_length=1), Tag("list")]],
                  Discriminator(json_kind)]


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses shape: chat's function definition at the top level."""

    type: Literal["function"]

    def chat_tool(self) -> ChatTool:
        return ChatTool(type="function", function=FunctionDefinition(**self.model_dump(exclude={"type"})))


class FunctionChoice(RequestBody):
    type: Literal["function"]
    name: str


class TextFormat(RequestBody):
    """``text.format``: free text, any JSON object, or JSON under a schema (always enforced, as ``strict`` asks)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None  # informational, as in chat's response_format
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise InvalidParameter("text.format.schema", "text.format of type json_schema needs a schema")
        if self.type != "json_schema" and self.schema_ is not None:
            raise InvalidParameter("text.format.schema", f"text.format.schema is only used with type json_schema, "
                                   f"not with type {self.type}")
        return self

    def response_format(self) -> ResponseFormat:
        """The same format as chat's ``response_format``."""
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        schema = JSONSchemaFormat(name=self.name or "response", description=self.description, schema=self.schema_,
                                  strict=self.strict)
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(RequestBody):
    format: TextFormat | None = None


class ReasoningConfig(RequestBody):
    """OpenAI's ``reasoning`` options, none of which kvserve implements: each (``effort``, ``summary``) is refused
    by name. How a model thinks is its chat template's (``--reasoning-parser`` splits the thinking off)."""


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: Input
    instructions: Text | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    stream: StrictBool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # informational, as on chat: a safety id, a cache hint the automatic prefix cache does not need, the one tier
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # vLLM's, as on chat: names the answer as X-Request-Id does; a priority (--scheduling-policy priority); a salt
    # that shares this request's cached blocks only with requests of the same salt
    request_id: Text | None = None
    priority: StrictInt = 0
    cache_salt: Text | None = None
    # taken in the one value kvserve implements, refused otherwise
    store: StrictBool = False
    background: StrictBool = False
    include: list[str] | None = None
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None

    _chat: ChatCompletionRequest = PrivateAttr()

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, items: Any) -> Any:
        return only_types(items, INPUT_ITEM_TYPES, "item", default="message")

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        # OpenAI's built-in tools (web_search, file_search, code_interpreter, mcp, ...) run on OpenAI's side
        return only_types(tools, ("function",), "tool")

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, value: Any) -> Any:
        return known_tool_choice(value, "{'type': 'function', 'name': ...}")

    @model_validator(mode="after")
    def _refuse_what_is_not_implemented(self) -> ResponsesRequest:
        refused = {
            "store": (self.store, "kvserve stores no responses; send store: false"),
            "previous_response_id": (self.previous_response_id is not None,
                                     "kvserve stores no responses; send the whole conversation in input"),
            "background": (self.background, "kvserve answers every response in the foreground"),
            "include": (bool(self.include), "kvserve adds nothing to its responses on request"),
            "truncation": (self.truncation == "auto", "kvserve does not truncate a conversation; send one that fits"),
        }
        for name, (is_refused, why) in refused.items():
            if is_refused:
                raise InvalidParameter(name, f"{name} is not supported: {why}")
        return self

    @model_validator(mode="after")
    def _as_chat(self) -> ResponsesRequest:
        """The chat request this stands for, made once here, so that what it refuses is this body's 400."""
        self._chat = ResponsesChatRequest.made(
            model=self.model, messages=self._messages(), max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, parallel_tool_calls=self.parallel_tool_calls,
            tools=None if self.tools is None else [tool.chat_tool() for tool in self.tools],
            tool_choice=self._chat_tool_choice(), stream=self.stream, metadata=self.metadata, user=self.user,
            response_format=self.text.format.response_format() if self.text and self.text.format else None,
            safety_identifier=self.safety_identifier, prompt_cache_key=self.prompt_cache_key,
            service_tier=self.service_tier, request_id=self.request_id, priority=self.priority,
            cache_salt=self.cache_salt)
        return self

    @property
    def chat_request(self) -> ChatCompletionRequest:
        return self._chat

    def _messages(self) -> list[dict[str, Any]]:
        """The instructions as the system message, then the input items as chat messages: a run of function calls
        joins the assistant message before it (or makes one), each call's output is a tool message."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        reasoning = ""  # a reasoning item's text, for the assistant message its turn makes next
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning = "\n".join(filter(None, (reasoning, item.text)))
            elif isinstance(item, MessageItem):
                messages.append(item.chat_message())
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}}
                if not messages or messages[-1]["role"] != "assistant" or reasoning:
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(call)
            elif isinstance(item, FunctionCallOutputItem):
                output = item.output if isinstance(item.output, str) else "\n".join(p.text for p in item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            if reasoning and not isinstance(item, ReasoningItem):
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1]["reasoning"] = reasoning
                reasoning = ""  # thinking before a turn of another role belongs to no answer: not rendered
        return messages  # validated as the chat request's

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, FunctionChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    @property
    def tool_choice_echo(self) -> str | dict[str, Any]:
        """``tool_choice`` as a response states it: the request's, else OpenAI's default, auto."""
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    @property
    def text_echo(self) -> dict[str, Any]:
        if self.text is None or self.text.format is None:
            return {"format": {"type": "text"}}
        return {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}


class ResponsesChatRequest(StandInChatRequest):
    """The chat request a Responses request stands for."""

    SENT_NAMES: ClassVar[dict[str, str]] = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input",
                                            "response_format": "text.format"}


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The thinking ``--reasoning-parser`` split off, as vLLM answers it: its text, no summary."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Union[OutputMessage, OutputFunctionCall, OutputReasoning]


class InputTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's (a required field of the SDK's usage): no cache write is charged here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int  # output tokens of the thinking, its end tag included


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseError(BaseModel):
    """Why a response failed (a stream's ``response.failed``: the engine failed midway)."""

    code: Literal["server_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    """OpenAI's response object: the request's settings stated back, the output items, the usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: None = None
    store: Literal[False] = False
    background: Literal[False] = False
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    service_tier: Literal["default"] = "default"
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None
