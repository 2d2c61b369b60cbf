"""Request bodies: a field kvserve does not know is refused by name (never silently ignored), a field sent as null
takes its default; OpenAI's own fields are honoured, accepted where they change nothing, or refused by name."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvserve.sampling_params import InvalidParameter, SamplingParams
from kvserve.server.errors import _validation_message
from kvserve.server.chat_protocol import ChatCompletionRequest
from kvserve.server.completion_protocol import CompletionRequest
from kvserve.server.model_protocol import TokenizeRequest


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}], "temprature": 0.5},
    {"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {}},
    {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True, "usage_per_chunk": True}},
    {"messages": [{"role": "user", "content": "hi", "cache_control": {}}]},
])
def test_an_unknown_field_is_refused_by_name(body: dict) -> None:
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate(body)
    (error,) = raised.value.errors()
    assert error["type"] == "extra_forbidden"


def test_a_field_sent_as_null_takes_its_default() -> None:
    nulls = dict.fromkeys(("n", "stream", "logprobs", "presence_penalty", "frequency_penalty",
                           "parallel_tool_calls", "unknown_but_null"))
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **nulls})
    assert (chat.n, chat.stream, chat.logprobs, chat.parallel_tool_calls) == (1, False, False, True)
    completion = CompletionRequest.model_validate({"prompt": "x", "echo": None, "max_tokens": None})
    assert completion.echo is False and completion.max_tokens is None  # null max_tokens: up to the context


def test_booleans_are_strict() -> None:
    with pytest.raises(ValidationError, match="stream"):
        CompletionRequest.model_validate({"prompt": "x", "stream": "yes"})


@pytest.mark.parametrize("fields, param, starts", [
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs", "top_logprobs must be -1 (the whole vocabulary) or >= 0"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ({"temperature": -1.0}, "temperature", "temperature must be a finite number >= 0"),
    ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias", "logit_bias: key"),
    ({"logit_bias": {"\uff11": 1.0}}, "logit_bias", "logit_bias: key"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "structured_outputs.choice must be"),
    ({"structured_outputs": {}}, "structured_outputs", "structured_outputs takes exactly one"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "guided_choice must be a non-empty list"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "give one constraint, not several"),
])
def test_a_value_out_of_range_names_the_field_the_request_sent(fields: dict, param: str, starts: str) -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
    with pytest.raises(InvalidParameter) as raised:
        body.to_sampling_params(PLAIN)
    error = body.named_as_sent(raised.value)
    assert isinstance(error, InvalidParameter) and error.param == param and str(error).startswith(starts), error


@pytest.mark.parametrize("message, fragment", [
    ({"role": "user"}, "a message of role user needs content"),
    ({"role": "system", "content": []}, "a message of role system needs content"),
    ({"role": "assistant", "content": None}, "a message of role assistant needs content"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "content parts of type image_url are not supported"),
    # the openai SDK's copies of an answer's content and thinking come back on its own (assistant) message only
    ({"role": "user", "content": "hi", "parsed": {"x": 1}}, "only assistant messages carry parsed"),
    ({"role": "tool", "tool_call_id": "c1", "content": "4", "reasoning": "x"},
     "only assistant messages carry reasoning"),
])
def test_a_message_without_text_or_with_anothers_fields_is_refused(message: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        ChatCompletionRequest.model_validate({"messages": [message]})


def test_an_assistant_message_with_tool_calls_may_leave_content_out() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "4"}]}
    assert len(ChatCompletionRequest.model_validate(body).messages) == 3


PLAIN = SamplingParams()  # SamplingParams' own defaults, a model without generation_config.json's
MESSAGES = [{"role": "user", "content": "hi"}]


def test_fields_that_change_nothing_are_accepted() -> None:
    body = {"messages": MESSAGES, "service_tier": "auto", "metadata": {"team": "a"}, "prompt_cache_key": "k",
            "store": False, "safety_identifier": "user-1", "user": "u", "modalities": ["text"]}
    assert ChatCompletionRequest.model_validate(body).to_sampling_params(PLAIN).n == 1


@pytest.mark.parametrize("extra, fragment", [
    ({"store": True}, "store is not supported"),
    ({"verbosity": "low"}, "verbosity is not supported"),
    ({"service_tier": "flex"}, "service_tier"),
])
def test_openai_fields_kvserve_does_not_implement_are_refused_by_name(extra: dict, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, **extra})


def test_best_of_is_honoured_only_as_n() -> None:
    assert CompletionRequest.model_validate({"prompt": "x", "n": 2, "best_of": 2}).to_sampling_params(PLAIN).n == 2
    with pytest.raises(ValidationError, match="best_of other than n"):
        CompletionRequest.model_validate({"prompt": "x", "best_of": 3})


@pytest.mark.parametrize("body, expected", [
    ({"prompt": [True]}, "prompt.0: Input should be a valid integer"),
    ({"prompt": [1.5]}, "prompt.0: Input should be a valid integer"),
    ({"prompt": [[1, 2], [3.5]]}, "prompt.1.0: Input should be a valid integer"),
    ({"prompt": ["ok", "a\ud800b"]},
     "prompt.1: the text is not valid UTF-8: it holds a lone surrogate (U+D800 to U+DFFF alone)"),
    ({"prompt": ["ok", 1]}, "prompt.1: Input should be a valid string"),
])
def test_a_prompt_that_fits_no_form_is_told_about_the_form_it_has(body: dict, expected: str) -> None:
    """The error of the form the value has (a list of token ids for ``[1.5]``), not pydantic's first union
    member's, which said "Input should be a valid string" for all of these."""
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate(body)
    assert _validation_message(RequestValidationError(raised.value.errors()))[0] == expected


def test_a_text_part_without_text_is_told_so() -> None:
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert _validation_message(RequestValidationError(raised.value.errors())) == (
        "messages.0.content.0.text: Field required", "messages.0.content.0.text")


def test_tokenize_takes_add_generation_prompt_with_messages_only() -> None:
    with pytest.raises(ValidationError, match="add_generation_prompt applies to messages"):
        TokenizeRequest.model_validate({"prompt": "hi", "add_generation_prompt": False})
    chat = TokenizeRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert chat.add_special_tokens is None and chat.add_generation_prompt is None  # the server's defaults


@pytest.mark.parametrize("cls, body, param, fragment", [
    (ChatCompletionRequest, {"messages": MESSAGES, "structured_outputs": {"regex": 5}}, "structured_outputs.regex",
     "valid string"),
    (ChatCompletionRequest, {"messages": MESSAGES, "structured_outputs": {"json": {}, "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "kvserve does not know or implement this field"),
    (ChatCompletionRequest, {"messages": MESSAGES, "response_format": {"type": "json_object", "json_schema": {
        "schema": {"type": "object"}}}}, "response_format.json_schema", "only used with type json_schema"),
    (ChatCompletionRequest, {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
     "response_format.json_schema", "needs json_schema.schema"),
    (ChatCompletionRequest, {"messages": MESSAGES, "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation", "does not pad stream deltas"),
    (ChatCompletionRequest, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    (ChatCompletionRequest, {"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice", "needs tools"),
    (TokenizeRequest, {"prompt": "hi", "messages": MESSAGES}, "prompt", "exactly one of prompt or messages"),
])
def test_a_refused_body_names_the_field(cls: type, body: dict, param: str, fragment: str) -> None:
    """Nested fields by their whole path, as OpenAI's ``param`` names them."""
    with pytest.raises(ValidationError) as raised:
        cls.model_validate(body)
    message, named = _validation_message(RequestValidationError(raised.value.errors()))
    assert named == param and fragment in message, (message, named)


def test_stream_options_take_include_obfuscation_false() -> None:
    """What kvserve always does (OpenAI pads stream deltas unless told not to)."""
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_obfuscation": False,
                                                                    "include_usage": True}}
    assert ChatCompletionRequest.model_validate(body).include_usage


SAMPLING_FIELDS = {  # each a value of its own, none the default: a swap of two fields shows
    "n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
    "presence_penalty": 1.5, "frequency_penalty": -0.5, "seed": 11, "min_tokens": 2, "stop": ["###"],
    "stop_token_ids": [7], "ignore_eos": True, "include_stop_str_in_output": True, "skip_special_tokens": False,
}


@pytest.mark.parametrize("cls, body", [(CompletionRequest, {"prompt": "x", "max_tokens": 9}),
                                       (ChatCompletionRequest, {"messages": MESSAGES, "max_tokens": 9})])
def test_each_sampling_field_lands_on_the_engines_field_of_its_name(cls: type, body: dict) -> None:
    params = cls.model_validate({**body, **SAMPLING_FIELDS, "logit_bias": {"5": 2.5}}).to_sampling_params(PLAIN)
    assert {name: getattr(params, name) for name in SAMPLING_FIELDS} == SAMPLING_FIELDS
    assert (params.max_tokens, params.logit_bias) == (9, {5: 2.5})


@pytest.mark.parametrize("bias", [100, -100, 100.0, -99.99])
def test_a_logit_bias_at_openais_bounds_is_accepted(bias: float) -> None:
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "logit_bias": {"5": bias}})
    assert body.to_sampling_params(PLAIN).logit_bias == {5: bias}


@pytest.mark.parametrize("bias", [100.01, -100.01])
def test_a_logit_bias_past_openais_bounds_is_refused(bias: float) -> None:
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "logit_bias": {"5": bias}})
    with pytest.raises(InvalidParameter, match="outside \\[-100, 100\\]") as raised:
        body.to_sampling_params(PLAIN)
    assert raised.value.param == "logit_bias"


@pytest.mark.parametrize("num_prompts, n", [(2048, 1), (1024, 2)])
def test_a_batch_of_up_to_2048_samples_is_accepted(num_prompts: int, n: int) -> None:
    assert len(CompletionRequest.model_validate({"prompt": ["x"] * num_prompts, "n": n}).prompts) == num_prompts


@pytest.mark.parametrize("num_prompts, n", [(2049, 1), (1025, 2)])
def test_a_batch_of_more_than_2048_samples_is_refused_naming_the_prompt(num_prompts: int, n: int) -> None:
    with pytest.raises(ValidationError) as raised:
        CompletionRequest.model_validate({"prompt": ["x"] * num_prompts, "n": n})
    message, named = _validation_message(RequestValidationError(raised.value.errors()))
    assert named == "prompt" and "at most 2,048" in message, message


def test_max_completion_tokens_wins_over_the_deprecated_max_tokens() -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 9}
    assert ChatCompletionRequest.model_validate(body).to_sampling_params(PLAIN).max_tokens == 9


def test_chat_logprobs_without_top_logprobs_asks_for_the_chosen_tokens_alone() -> None:
    params = ChatCompletionRequest.model_validate({"messages": MESSAGES, "logprobs": True}).to_sampling_params(PLAIN)
    assert params.logprobs == 0
    assert ChatCompletionRequest.model_validate({"messages": MESSAGES}).to_sampling_params(PLAIN).logprobs is None


def test_structured_outputs_takes_the_engines_fields_and_no_other() -> None:
    """The wire model and the engine's dataclass list the same constraints (a field added to one alone would be
    refused by name, or never reach the engine), but for where a constraint begins, which the chat server sets
    itself under --reasoning-parser (the thinking's end token)."""
    import dataclasses

    from kvserve.sampling_params import StructuredOutputsParams
    from kvserve.server.protocol import StructuredOutputsBody

    wire = {info.alias or name for name, info in StructuredOutputsBody.model_fields.items()}
    assert wire | {"begins_after_token_id"} == {field.name for field in dataclasses.fields(StructuredOutputsParams)}


@pytest.mark.parametrize("cls, body", [(CompletionRequest, {"prompt": "x"}),
                                       (ChatCompletionRequest, {"messages": MESSAGES})])
def test_the_models_sampling_defaults_fill_only_the_fields_a_request_leaves_out(cls, body) -> None:
    model_defaults = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1)
    params = cls.model_validate({**body, "temperature": 0.0, "top_k": 5}).to_sampling_params(model_defaults)
    assert (params.temperature, params.top_k) == (0.0, 5)  # the request's own
    assert (params.top_p, params.min_p, params.repetition_penalty) == (0.9, 0.05, 1.1)  # the model's
