"""The request and response bodies the OpenAI-compatible endpoints share (pydantic), and their mapping to
SamplingParams; each endpoint's own bodies are in ``completion_protocol``, ``chat_protocol`` and
``model_protocol``.

Ranges are checked by ``SamplingParams`` (its ValueError becomes a 400), except OpenAI's bounds that hold over
HTTP alone, checked by the bodies: ``logit_bias`` within ±100 (``SamplingRequest``; offline any finite bias
goes, as vLLM bounds it only in its server) and at most ``MAX_BATCH_SAMPLES`` samples a request
(``completion_protocol.CompletionRequest``).

A field kvserve does not know is refused by name, as OpenAI's server does (vLLM's ignores it): a misspelt or
unimplemented field never silently does nothing. A field sent as null asks for its default.
"""

from __future__ import annotations

import functools
import re
import typing
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    model_serializer,
    model_validator,
)

from kvserve.sampling_params import BeamSearchParams, InvalidParameter, SamplingParams, StructuredOutputsParams
from kvserve.utf8 import check_utf8

MAX_LOGIT_BIAS = 100.0
_CLIENT_ID = re.compile(r"[^\x00-\x1f\x7f]+")


def check_request_id(request_id: str | None) -> None:
    """vLLM's ``request_id`` field held to what X-Request-Id's header may hold: a line break in a log line's id
    would forge a line."""
    if request_id is not None and not _CLIENT_ID.fullmatch(request_id):
        raise InvalidParameter("request_id", "request_id must be non-empty and hold no control characters")


def _check_utf8(text: str) -> str:
    return check_utf8(text, "the text")  # JSON can carry a lone surrogate ("\\ud800")


Text = Annotated[str, AfterValidator(_check_utf8)]
TokenIds = list[StrictInt]


def only_types(values: Any, allowed: tuple[str, ...], what: str, default: str | None = None) -> Any:
    """``values`` (a list of dicts with a ``type``) as sent, or ValueError naming the first whose type kvserve does
    not take (pydantic's own union error listed tags, not what to send); the error's place is the field's."""
    if not isinstance(values, list):
        return values
    for i, value in enumerate(values):
        kind = value.get("type", default) if isinstance(value, dict) else None
        if isinstance(value, dict) and kind not in allowed:
            raise ValueError(f"{what} {i} is of type {str(kind)[:100]!r}, which kvserve does not take (it takes "
                             f"{', '.join(allowed)})")
    return values


def json_kind(value: Any) -> str:
    """Which member of a text-or-list field ``value`` is, told apart by its JSON kind (so that an error is about the
    kind sent, not about every member)."""
    return "list" if isinstance(value, list) else "str"


class RequestBody(BaseModel):
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


class StreamOptions(RequestBody):
    include_usage: StrictBool = False
    # vLLM's: every chunk carries its choice's usage so far, besides the last chunk's total
    continuous_usage_stats: StrictBool = False
    # OpenAI pads stream deltas with random text unless this is false; kvserve never does
    include_obfuscation: StrictBool | None = None

    @model_validator(mode="after")
    def _no_obfuscation(self) -> StreamOptions:
        if self.include_obfuscation:
            raise InvalidParameter("stream_options.include_obfuscation", "stream_options.include_obfuscation: "
                                   "kvserve does not pad stream deltas; leave it out or set it to false")
        return self

    @model_validator(mode="after")
    def _continuous_usage_with_usage(self) -> StreamOptions:
        # vLLM ignores it without include_usage: refused here rather than doing nothing
        if self.continuous_usage_stats and not self.include_usage:
            raise InvalidParameter("stream_options.continuous_usage_stats",
                                   "stream_options.continuous_usage_stats needs stream_options.include_usage true")
        return self


class JSONSchemaFormat(RequestBody):
    name: str = "response"
    description: str | None = None  # informational, as in vLLM: the schema alone constrains the output
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(RequestBody):
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


class StructuredOutputsBody(RequestBody):
    """vLLM's ``structured_outputs``: one of its constraints (``StructuredOutputsParams``); its other keys are
    refused by name."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: StrictBool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**self.model_dump(exclude_defaults=True, by_alias=True))


class SamplingRequest(RequestBody):
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
    allowed_token_ids: TokenIds | None = None
    bad_words: list[Text] | None = None
    truncate_prompt_tokens: StrictInt | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # true (vLLM's default) is how the tokenizer's own decoder joins special tokens, which kvserve's detokenizer runs
    spaces_between_special_tokens: StrictBool = True
    prompt_logprobs: StrictInt | None = None
    # vLLM's answer extras: logprob entries spelled "token_id:<id>", the prompt's and each choice's token ids
    return_tokens_as_token_ids: StrictBool = False
    return_token_ids: StrictBool = False
    # vLLM's: names the answer (its id) and the log lines, as X-Request-Id does; the header wins where both come
    request_id: Text | None = None
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
    # vLLM's: the prefix cache shares this request's blocks only with requests sent with the same salt (checked,
    # a non-empty string, with the prompt: ``input_processor``)
    cache_salt: Text | None = None
    # vLLM's: the lower, the sooner, under --scheduling-policy priority (any other value is a 400 without it)
    priority: StrictInt = 0
    # vLLM's beam search: n beams, ranked by cumulative logprob over length ** length_penalty
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0
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
    def _check_vllm_extras(self) -> SamplingRequest:
        check_request_id(self.request_id)
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: a stream's chunks have no place for them
            raise InvalidParameter("prompt_logprobs", "prompt_logprobs are not available when stream is true")
        if not self.spaces_between_special_tokens and not self.skip_special_tokens:
            # with skip_special_tokens no special token is text, so false changes nothing there (as in vLLM)
            raise InvalidParameter("spaces_between_special_tokens", "spaces_between_special_tokens false is not "
                                   "supported: kvserve joins special tokens as the tokenizer's own decoder does "
                                   "(vLLM's default, true)")
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

    # what beam search takes no part in (it draws each token with its own params): refused by name where sent
    BEAM_SEARCH_REFUSES: ClassVar[tuple[str, ...]] = (
        "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
        "seed", "min_tokens", "stop", "stop_token_ids", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
        "prompt_logprobs",
    )

    @model_validator(mode="after")
    def _check_beam_search(self) -> SamplingRequest:
        if not self.use_beam_search:
            if self.length_penalty != 1.0:  # vLLM ignores it without beam search
                raise InvalidParameter("length_penalty", "length_penalty is only used with use_beam_search true")
            return self
        if self.stream:
            raise InvalidParameter("stream", "use_beam_search does not stream (as in vLLM): send stream false")
        if not 1 <= self.n <= BeamSearchParams.MAX_BEAM_WIDTH:  # the beam width's range, not sampling's
            raise InvalidParameter("n", f"n (the beam width) must be in [1, {BeamSearchParams.MAX_BEAM_WIDTH}] with "
                                   f"use_beam_search, got {self.n}")
        defaults = type(self).model_fields
        refused = [name for name in self.BEAM_SEARCH_REFUSES if getattr(self, name) != defaults[name].default]
        refused += list(self._constraints())
        if refused:
            raise InvalidParameter(refused[0], f"{refused[0]} is not supported with use_beam_search (which ranks "
                                   "the model's own logprobs and stops only at EOS or max_tokens)")
        return self

    def beam_search_params(self, max_tokens: int, defaults: SamplingParams) -> BeamSearchParams:
        """vLLM's: ``n`` beams of ``max_tokens``; ValueError naming the field as the request sent it."""
        try:
            return BeamSearchParams(
                beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                temperature=defaults.temperature if self.temperature is None else self.temperature,
                length_penalty=self.length_penalty, include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except InvalidParameter as error:
            raise error.renamed("n") if error.param == "beam_width" else self.named_as_sent(error) from None

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

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def named_as_sent(self, error: ValueError) -> ValueError:
        """``error`` told of the parameter by the name this request sent it as, where the engine's differs."""
        if isinstance(error, InvalidParameter) and error.param in self._sent_names():
            return error.renamed(self._sent_names()[error.param])
        return error

    def _sent_names(self) -> dict[str, str]:
        """The engine's names of parameters this request sent under other names."""
        return {}

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: SamplingParams,
                        **extra: Any) -> SamplingParams:
        """The engine's SamplingParams, the fields this request leaves out taken from ``defaults`` (the model's:
        ``LLMEngine.default_sampling_params``); raises ValueError naming the first field out of range."""
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
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            **extra,
        )


def _token_bias(logit_bias: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's bound on each bias (SamplingParams reads the keys as token ids)."""
    for key, value in (logit_bias or {}).items():
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidParameter("logit_bias", f"logit_bias: value {value} for token {key} is outside [-100, 100]")
    return logit_bias


class WithExtras(BaseModel):
    """An answer, or a part of one, holding vLLM's extras (``EXTRAS``: token ids, prompt logprobs), which it
    carries only where the request asked for them (None: not asked), as OpenAI's clients know none of them."""

    EXTRAS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _extras_asked_for(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in self.EXTRAS:
            if name in data and data[name] is None:
                del data[name]
        return data


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

