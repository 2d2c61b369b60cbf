"""The OpenAI-compatible request and response bodies (pydantic), and their mapping to SamplingParams.

Ranges are checked once, by ``SamplingParams`` (its ValueError becomes a 400); the models here check shapes
and types only. A field kvserve does not know is refused by name, as OpenAI's server does (vLLM's ignores it):
a misspelt or unimplemented field never silently does nothing. A field sent as null asks for its default.
"""

from __future__ import annotations

import functools
import time
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

from kvserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams
from kvserve.server.tools import tool_constraint

MAX_LOGIT_BIAS = 100.0


def _check_utf8(text: str) -> str:
    """JSON can carry a lone surrogate ("\\ud800"), which is no UTF-8 text and no tokenizer input."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text is not valid UTF-8 (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_check_utf8)]
TokenIds = list[StrictInt]


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


class _Body(BaseModel):
    """A request body: unknown fields are refused by name (pydantic's ``extra_forbidden``, which the error
    handler words), and a field sent as null takes its default, as OpenAI's nullable fields do."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            nullable = _nullable_fields(cls)
            return {key: value for key, value in data.items() if value is not None or key in nullable}
        return data


@functools.cache
def _nullable_fields(model: type[BaseModel]) -> frozenset[str]:
    """The names and aliases of a body's fields where null is a value of its own (``max_tokens: null``: no
    limit), once per class; null for any other field, or an unknown one, is left out of the body."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        if info.annotation is Any or type(None) in typing.get_args(info.annotation):
            names.update(filter(None, (name, info.alias)))
    return frozenset(names)


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # OpenAI pads stream deltas with random text unless this is false; kvserve never does
    include_obfuscation: StrictBool | None = None

    @model_validator(mode="after")
    def _no_obfuscation(self) -> StreamOptions:
        if self.include_obfuscation:
            raise InvalidParameter("stream_options.include_obfuscation", "stream_options.include_obfuscation: "
                                   "kvserve does not pad stream deltas; leave it out or set it to false")
        return self


class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None  # informational, as in vLLM: the schema alone constrains the output
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON under a schema (kvserve always
    enforces the schema, as ``strict`` asks)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise InvalidParameter("response_format.json_schema",
                                   "response_format of type json_schema needs json_schema.schema")
        if self.type != "json_schema" and self.json_schema is not None:  # most likely meant type json_schema
            raise InvalidParameter("response_format.json_schema", f"response_format.json_schema is only used with "
                                   f"type json_schema, not with type {self.type}")
        return self

    def params(self) -> StructuredOutputsParams:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        assert self.json_schema is not None and self.json_schema.schema_ is not None
        return StructuredOutputsParams(json=self.json_schema.schema_)


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs``: one of its constraints (``StructuredOutputsParams``); its other keys are
    refused by name."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: StrictBool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**self.model_dump(exclude_defaults=True, by_alias=True))


class SamplingRequest(_Body):
    """The fields completions and chat completions share, vLLM's extras included."""

    model: str | None = None
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Text | list[Text] | None = None
    seed: StrictInt | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # structured output: OpenAI's response_format, vLLM's guided_* extras and its newer structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # OpenAI fields that change nothing here: informational (user, safety_identifier, metadata), or a cache hint
    # the automatic prefix cache does not need (prompt_cache_key); service_tier only in its default meanings
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # OpenAI fields kvserve does not implement: refused by name rather than ignored
    store: StrictBool | None = None
    verbosity: str | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options", "stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _refuse_what_is_not_implemented(self) -> SamplingRequest:
        unsupported = {
            "functions": self.functions, "function_call": self.function_call,
            "audio": self.audio, "prediction": self.prediction, "web_search_options": self.web_search_options,
            "reasoning_effort": self.reasoning_effort, "verbosity": self.verbosity,
            "store": self.store or None,
            "modalities": None if self.modalities in (None, ["text"]) else self.modalities,
        }
        for name, value in unsupported.items():
            if value is not None:
                hint = " (OpenAI deprecated it: use tools)" if name.startswith("function") else ""
                raise InvalidParameter(name, f"{name} is not supported by kvserve yet{hint}")
        return self

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for, from whichever field names it; InvalidParameter for
        several."""
        given = self._constraints()
        if len(given) > 1:
            raise InvalidParameter(list(given)[1], f"give one constraint, not several: {', '.join(given)}")
        return next(iter(given.values()), None)

    @property
    def constraint_field(self) -> str | None:
        """The field the request's constraint came in (a constraint that does not compile is a 400 naming it)."""
        return next(iter(self._constraints()), None)

    def _constraints(self) -> dict[str, StructuredOutputsParams]:
        given: dict[str, StructuredOutputsParams] = {}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format.params()
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                try:
                    given[name] = StructuredOutputsParams(**{key: getattr(self, name)})
                except InvalidParameter as error:
                    raise error.renamed(name) from None
        if self.structured_outputs is not None:
            try:
                given["structured_outputs"] = self.structured_outputs.params()
            except InvalidParameter as error:  # a field of it, or the whole of it
                whole = error.param == "structured_outputs"
                raise (error if whole else error.renamed(f"structured_outputs.{error.param}")) from None
        return given

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def named_as_sent(self, error: ValueError) -> ValueError:
        """``error`` told of the parameter by the name this request sent it as, where the engine's differs."""
        if isinstance(error, InvalidParameter) and error.param in self._sent_names():
            return error.renamed(self._sent_names()[error.param])
        return error

    def _sent_names(self) -> dict[str, str]:
        """The engine's names of parameters this request sent under other names."""
        return {}

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **extra: Any) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError naming the first field out of range."""
        defaults = SamplingParams()
        return SamplingParams(
            n=self.n,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            repetition_penalty=defaults.repetition_penalty if self.repetition_penalty is None
            else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=_token_bias(self.logit_bias),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            **extra,
        )


def _token_bias(logit_bias: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's bound on each bias (SamplingParams reads the keys as token ids)."""
    for key, value in (logit_bias or {}).items():
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidParameter("logit_bias", f"logit_bias: value {value} for token {key} is outside [-100, 100]")
    return logit_bias


# ---- completions ----

Prompt = Annotated[
    Union[Annotated[Text, Tag("str")], Annotated[list[Text], Tag("list[str]")], Annotated[TokenIds, Tag("list[int]")],
          Annotated[list[TokenIds], Tag("list[list[int]]")]],
    Discriminator(_shape),
]


MAX_BATCH_SAMPLES = 2048  # prompts x n of one /v1/completions request (OpenAI takes up to 2,048 prompts)


class CompletionRequest(SamplingRequest):
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
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    @property
    def scores_prompt(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the prompt back with its logprobs and no completion (how evaluation
        harnesses score a text)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        # scoring runs one step, whose token the answer leaves out: the prompt's logprobs come with the first
        max_tokens = 1 if self.scores_prompt else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs=prompt_logprobs)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
        )


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ---- chat completions ----


class TextContentPart(_Body):
    type: Literal["text"]
    text: Text


Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Role
    content: Annotated[Union[Annotated[Text, Tag("str")], Annotated[list[TextContentPart], Tag("list[part]")]],
                       Discriminator(lambda v: "list[part]" if isinstance(v, list) else "str")] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

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
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

class FunctionDefinition(_Body):
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


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # OpenAI's default: auto with tools, none without
    parallel_tool_calls: StrictBool = True

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

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None  # OpenAI's field for a model that refuses: always there, and null here
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: Literal["default"] = "default"  # the one tier kvserve serves in


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: Literal["default"] = "default"


# ---- models, tokenizer ----


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str
    max_model_len: int | None  # None while the model loads


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Body):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template) is tokenized."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    # the tokenizer's special tokens (BOS) added: by default to a prompt, not to messages, whose template holds
    # those it wants (vLLM's defaults)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None  # messages only; default true

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidParameter("prompt", "give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.prompt is not None and self.add_generation_prompt is not None:
            raise InvalidParameter("add_generation_prompt", "add_generation_prompt applies to messages, not to a "
                                                            "prompt")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


