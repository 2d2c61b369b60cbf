"""The bodies of POST /v1/chat/completions: messages and the tools they may call in; an assistant message, or
its streamed deltas, out."""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from kvserve.engine.chat_messages import joined
from kvserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams
from kvserve.server.protocol import RequestBody, SamplingRequest, Text, Usage, WithExtras
from kvserve.server.response_extras import PromptLogprobs
from kvserve.server.tools import tool_constraint


class TextContentPart(RequestBody):
    type: Literal["text"]
    text: Text


Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionCall(RequestBody):
    name: str
    arguments: str  # JSON text of an object
    # the openai SDK's parse of the arguments (chat.completions.parse with strict tools), which it sends back with
    # the message: a copy of ``arguments``, left out of what the template renders
    parsed_arguments: Any = Field(default=None, exclude=True)


class ToolCall(RequestBody):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    role: Role
    content: Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[TextContentPart], Tag("list[part]")]],
                       Discriminator(lambda v: "list[part]" if isinstance(v, list) else "str")] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers
    # an assistant's thinking as kvserve answers it (vLLM's field, split off by --reasoning-parser): handed to the
    # template, which decides whether to render it (Qwen3's keeps it within a tool-call chain), as vLLM does
    reasoning: Text | None = None
    # the openai SDK's parse of the content (chat.completions.parse with a response_format), which it sends back
    # with the message: a copy of ``content``, left out of what the template renders
    parsed: Any = Field(default=None, exclude=True)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if isinstance(content, list):
            kinds = {str(part.get("type")) if isinstance(part, dict) else type(part).__name__ for part in content}
            if kinds - {"text"}:
                raise ValueError(f"content parts of type {', '.join(sorted(kinds - {'text'}))} are not "
                                 "supported: kvserve serves text models, whose parts are of type text")
        return content

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.content in (None, []) and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a message of role {self.role} needs content (only an assistant's message with tool_calls "
                             "may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        for field in ("reasoning", "parsed"):  # the answer's own: on another role, a field nothing would read
            if getattr(self, field) is not None and self.role != "assistant":
                raise ValueError(f"only assistant messages carry {field}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # a grammar enforces the schema under tool_choice required or named; under auto the model writes its own calls,
    # and a strict function's call whose arguments break its schema is no call (server/tools.py)
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None and parameters.get("type") != "object":
            raise ValueError("a function's parameters must be a JSON schema of type object (its arguments are a "
                             f"JSON object), got type {parameters.get('type')!r}")
        return parameters


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICES = ("none", "auto", "required")
ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


def known_tool_choice(value: Any, named_shape: str) -> Any:
    """``value`` if it is a tool choice kvserve takes (one of ``TOOL_CHOICES`` or a named function, whose shape
    the body's type checks), else InvalidParameter naming OpenAI's other forms (``allowed_tools``, a custom or
    built-in tool), where a union's error said only "Input should be 'none', 'auto' or 'required'", as if a named
    function were not taken either; ``named_shape``: how the endpoint spells a named function."""
    if value is None or isinstance(value, str) and value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return value
    kind = value.get("type") if isinstance(value, dict) else value
    raise InvalidParameter("tool_choice", f"tool_choice {str(kind)[:100]!r} is not supported: kvserve takes "
                           f"{', '.join(map(repr, TOOL_CHOICES))} or {named_shape}")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    # vLLM's: the last message left open for the model to go on with (with add_generation_prompt false), more
    # variables for the template, the tokenizer's special tokens (BOS) added to what the template renders
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = False
    # vLLM's: the last message's text before the reply, where it is the reply's role (an assistant's prefill)
    echo: StrictBool = False
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # OpenAI's default: auto with tools, none without
    parallel_tool_calls: StrictBool = True
    # vLLM's: false leaves the thinking a --reasoning-parser splits off out of the answer
    include_reasoning: StrictBool = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, value: Any) -> Any:
        return known_tool_choice(value, "{'type': 'function', 'function': {'name': ...}}")

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs to be true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidParameter("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise InvalidParameter("tool_choice", f"tool_choice names the function "
                                       f"{self.tool_choice.function.name!r}, which is not among the tools "
                                       f"({', '.join(names)})")
        return self

    @property
    def template_options(self) -> dict[str, Any]:
        """How the conversation renders (``InputProcessor.apply_chat_template``'s keywords)."""
        return {"add_generation_prompt": self.add_generation_prompt, "add_special_tokens": self.add_special_tokens,
                "continue_final_message": self.continue_final_message, "template_kwargs": self.chat_template_kwargs}

    @property
    def echoed_text(self) -> str:
        """What ``echo`` puts before each reply: the last message's text where it is the assistant's, whose role
        the reply has (a prefill that ``continue_final_message`` goes on from), as vLLM echoes; else nothing."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        return joined(last.model_dump()["content"])

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the constraint take them."""
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    def _constraints(self) -> dict[str, StructuredOutputsParams]:
        given = super()._constraints()
        if self.tools:
            constraint = tool_constraint(self.tool_dicts or [], self.effective_tool_choice, self.parallel_tool_calls)
            if constraint is not None:
                given["tool_choice"] = constraint
        return given

    def _sent_names(self) -> dict[str, str]:
        names = {"prompt": "messages"} | ({"logprobs": "top_logprobs"} if self.top_logprobs is not None else {})
        return names | ({"max_tokens": "max_completion_tokens"} if self.max_completion_tokens is not None else {})

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """The engine's SamplingParams; ``defaults`` (the model's) fill the fields left out."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, defaults, prompt_logprobs=self.prompt_logprobs)


class StandInChatRequest(ChatCompletionRequest):
    """The chat request another endpoint's request stands for (Responses', Messages'): an error about one of its
    fields names the field it came from (``SENT_NAMES``: the chat field's name -> the request's)."""

    SENT_NAMES: ClassVar[dict[str, str]] = {}

    @classmethod
    def made(cls, **fields: Any) -> StandInChatRequest:
        """The chat request of ``fields``, made as the other request is validated: what it refuses raised as the
        InvalidParameter that names the field, else a ValueError, so that it is that request's 400."""
        try:
            return cls(**fields)
        except ValidationError as error:
            first = error.errors()[0]
            cause = first.get("ctx", {}).get("error")
            raise cause if isinstance(cause, InvalidParameter) else ValueError(first["msg"]) from None

    def _sent_names(self) -> dict[str, str]:
        return self.SENT_NAMES

    @property
    def constraint_field(self) -> str | None:
        field = super().constraint_field
        return None if field is None else self.SENT_NAMES.get(field, field)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class WithReasoning(BaseModel):
    """A message whose ``reasoning`` (vLLM's field: the thinking ``--reasoning-parser`` split off) is sent only
    where it was set: a server without a parser answers as before, field for field."""

    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _reasoning_where_set(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if "reasoning" not in self.model_fields_set:
            data.pop("reasoning", None)
        return data


class AssistantMessage(WithReasoning):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None  # OpenAI's field for a model that refuses: always there, and null here
    tool_calls: list[ToolCall] | None = None


class ChatChoice(WithExtras):
    EXTRAS = ("token_ids",)

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(WithExtras):
    EXTRAS = ("prompt_logprobs", "prompt_token_ids")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: Literal["default"] = "default"  # the one tier kvserve serves in
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: ``id``, ``type`` and the function's name come once, in its first piece."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        data["function"] = {k: v for k, v in data["function"].items() if v is not None}
        return {k: v for k, v in data.items() if v is not None}


class DeltaMessage(WithReasoning):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(WithExtras):
    EXTRAS = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the chunk's tokens


class ChatCompletionChunk(WithExtras):
    EXTRAS = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: Literal["default"] = "default"
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: in the role chunks

