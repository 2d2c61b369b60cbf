"""Tool calling against a real ``kvserve serve``: the openai SDK and LangChain, every tool_choice, streamed and
whole, a full round trip through the chat template, and 400s naming what is wrong."""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL_NAME, ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
# Under tool_choice auto the model writes its own calls; this regex makes the tiny random model write a Hermes
# call (with content before it) so the server's parser has something to read.
HERMES_CALL = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "C"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server over the small checkpoint: its 2,048-token context has room for the tools' description."""
    from kvserve.model.checkpoint import make_checkpoint

    checkpoint = make_checkpoint(tmp_path_factory.mktemp("tool-ckpt") / "llama", "llama", "small", seed=0)
    server = ServerProcess([str(checkpoint), "--served-model-name", MODEL_NAME, "--num-kv-blocks", "512",
                            "--device", "cpu"], tmp_path_factory.mktemp("tool-logs"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tool_client(tool_server: ServerProcess) -> openai.OpenAI:
    return tool_server.openai()


def create(client: openai.OpenAI, **kwargs: Any):
    kwargs = {"messages": MESSAGES, "temperature": 0, "max_tokens": 120, **kwargs}
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def assert_valid_calls(calls: list, allowed: set[str]) -> list[tuple[str, dict]]:
    parsed = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    for name, arguments in parsed:
        assert name in allowed
        jsonschema.validate(arguments, SCHEMAS[name])
    assert len({c.id for c in calls}) == len(calls) and all(c.type == "function" for c in calls)
    return parsed


def streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[tuple[str, str]], str]:
    """Content, (name, arguments) per call and the finish reason, reassembled from the stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls_of_the_given_tools(tool_client: openai.OpenAI, parallel: bool) -> None:
    reply = create(tool_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=400)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = assert_valid_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    assert len(calls) >= 1 and (parallel or len(calls) == 1)


def test_a_named_function_is_called_with_valid_arguments(tool_client: openai.OpenAI) -> None:
    """A call of the function tool_choice names finishes "stop", as OpenAI and vLLM answer."""
    reply = create(tool_client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = assert_valid_calls(reply.choices[0].message.tool_calls, {"get_time"})
    assert len(calls) == 1 and reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("tool_choice, finish_reason", [
    ("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")])
def test_streamed_calls_equal_the_whole_ones(tool_client: openai.OpenAI, tool_choice, finish_reason: str) -> None:
    whole = create(tool_client, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False).choices[0]
    content, calls, finish = streamed_calls(tool_client, tools=TOOLS, tool_choice=tool_choice,
                                            parallel_tool_calls=False)
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason == finish_reason and content == ""


def test_auto_reads_the_models_own_calls_streamed_and_whole(tool_client: openai.OpenAI) -> None:
    extra = {"guided_regex": HERMES_CALL}
    whole = create(tool_client, tools=TOOLS, extra_body=extra).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking.\n"
    assert assert_valid_calls(whole.message.tool_calls, {"get_weather"}) == [
        ("get_weather", {"city": "Oslo", "unit": "C"})]
    content, calls, finish = streamed_calls(tool_client, tools=TOOLS, extra_body=extra)
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert content == whole.message.content and finish == "tool_calls"  # the whole content was stripped


def test_a_call_that_is_no_json_object_is_not_a_call(tool_client: openai.OpenAI) -> None:
    """As vLLM's parsers answer: the whole text as content, not a call whose arguments no client can parse under
    finish_reason tool_calls; a stream, which has sent the call's pieces, does not finish as tool_calls."""
    broken = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": \}\n</tool_call>'
    extra = {"guided_regex": broken}
    whole = create(tool_client, tools=TOOLS, extra_body=extra).choices[0]
    assert whole.message.tool_calls is None and whole.finish_reason == "stop"
    assert whole.message.content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    assert streamed_calls(tool_client, tools=TOOLS, extra_body=extra)[2] == "stop"


def test_auto_returns_no_call_of_an_undeclared_function(tool_client: openai.OpenAI) -> None:
    """OpenAI only ever calls the functions a request declares: a call of another is the model's text."""
    text = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    extra = {"guided_regex": re.escape(text)}
    whole = create(tool_client, tools=TOOLS, extra_body=extra).choices[0]
    assert whole.message.tool_calls is None and whole.message.content == text and whole.finish_reason == "stop"
    assert streamed_calls(tool_client, tools=TOOLS, extra_body=extra) == (text, [], "stop")
    beside = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n' + text
    whole = create(tool_client, tools=TOOLS, extra_body={"guided_regex": re.escape(beside)}, max_tokens=400).choices[0]
    assert whole.message.tool_calls is None and whole.message.content == beside and whole.finish_reason == "stop"


@pytest.mark.parametrize("strict", [True, False])
def test_auto_holds_a_strict_functions_call_to_its_schema(tool_client: openai.OpenAI, strict: bool) -> None:
    """Under auto no grammar writes the calls: one whose arguments break a strict function's schema is the
    model's text (a stream, which has sent its pieces, finishes stop); without strict it is a call."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"town": 5}}\n</tool_call>'
    extra = {"guided_regex": re.escape(text)}
    tools = [{"type": "function", "function": {**WEATHER["function"], "strict": strict}}]
    whole = create(tool_client, tools=tools, extra_body=extra).choices[0]
    if strict:
        assert whole.message.tool_calls is None and whole.message.content == text and whole.finish_reason == "stop"
    else:
        assert [c.function.arguments for c in whole.message.tool_calls] == ['{"town": 5}']
    assert streamed_calls(tool_client, tools=tools, extra_body=extra)[2] == whole.finish_reason


def test_whitespace_between_calls_is_no_content(tool_client: openai.OpenAI) -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    extra = {"guided_regex": re.escape(f"{call}\n{call}\n")}
    whole = create(tool_client, tools=TOOLS, extra_body=extra, max_tokens=400).choices[0]
    assert whole.message.content is None and len(whole.message.tool_calls) == 2
    assert whole.finish_reason == "tool_calls"
    content, calls, finish = streamed_calls(tool_client, tools=TOOLS, extra_body=extra, max_tokens=400)
    assert (content, len(calls), finish) == ("", 2, "tool_calls")


def test_the_sdks_stream_helper_reassembles_the_calls(tool_client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = create(tool_client, tools=TOOLS, tool_choice=choice).choices[0].message.tool_calls
    with tool_client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=120,
                                             tools=TOOLS, tool_choice=choice) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert final.finish_reason == "stop"


def test_auto_without_a_call_is_plain_content(tool_client: openai.OpenAI) -> None:
    reply = create(tool_client, tools=TOOLS, extra_body={"guided_regex": "No call needed"}).choices[0]
    assert reply.message.content == "No call needed" and reply.message.tool_calls is None
    assert reply.finish_reason == "stop"


def test_a_tool_round_trip_renders_the_call_and_its_result(tool_client: openai.OpenAI) -> None:
    first = create(tool_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = [*MESSAGES, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": -3})}]
    answer = create(tool_client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)
    without = create(tool_client, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens  # the call and its result were rendered


@pytest.mark.parametrize("body, fragment, param", [
    ({"tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name", "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "one constraint", "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions is not supported", "functions"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice 'allowed_tools' is not supported: kvserve takes 'none', 'auto', 'required' or", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice 'any' is not supported", "tool_choice"),
    *(({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "foo"}}}}}], "tool_choice": choice}, fragment,
       "tools.0.function.parameters")
      for choice, fragment in ((choice, "tools[0].function.parameters: no valid JSON schema") for choice in (
          "auto", "none", "required", {"type": "function", "function": {"name": "f"}}))),
    # every tool's schema is a JSON schema, whichever the named function is
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}],
      "tool_choice": {"type": "function", "function": {"name": TOOLS[0]["function"]["name"]}}},
     f"tools[{len(TOOLS)}].function.parameters: no valid JSON schema", f"tools.{len(TOOLS)}.function.parameters"),
    # a keyword no grammar enforces is refused only where a grammar holds the calls, named in the tool's schema
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters: the JSON schema uses 'uniqueItems' at #/properties/a",
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "must be a JSON schema of type object", "tools.0.function.parameters"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id", "messages.0"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "not JSON",
     "messages"),
])
def test_a_bad_tool_request_is_a_400_naming_it(tool_client: openai.OpenAI, body: dict, fragment: str,
                                               param: str) -> None:
    body = dict(body)
    messages = body.pop("messages", MESSAGES)
    with pytest.raises(openai.BadRequestError) as error:
        tool_client.chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=messages, extra_body=body)
    assert fragment in str(error.value) and error.value.body["param"] == param


def test_under_auto_a_schema_no_grammar_enforces_is_served(tool_client: openai.OpenAI) -> None:
    """Refused under auto too, though auto makes no grammar of the tools (OpenAI and vLLM answer it)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]
    assert create(tool_client, tools=tools, tool_choice="auto", max_tokens=4).choices[0].finish_reason


def test_tools_on_completions_are_a_400(tool_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="only supported on /v1/chat/completions"):
        tool_client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"tools": TOOLS})


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    unit: Literal["C", "F"]


def test_langchain_bind_tools_and_with_structured_output(tool_server: ServerProcess) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["C", "F"]) -> str:
        """The weather in a city."""
        return f"-3 {unit} in {city}"

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return "12:00"

    chat = ChatOpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", model=MODEL_NAME, temperature=0,
                      max_tokens=120, max_retries=0)
    for choice, allowed in (("required", {"get_weather", "get_time"}), ("get_weather", {"get_weather"})):
        message = chat.bind_tools([get_weather, get_time], tool_choice=choice, parallel_tool_calls=False).invoke(
            "What is the weather in Oslo?")
        assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] in allowed
        tool_by_name = {"get_weather": get_weather, "get_time": get_time}
        assert isinstance(tool_by_name[message.tool_calls[0]["name"]].invoke(message.tool_calls[0]["args"]), str)
    forecast = chat.with_structured_output(Forecast).invoke("The weather in Oslo, please.")
    assert isinstance(forecast, Forecast)


def test_a_function_without_parameters_is_called_with_none(tool_client: openai.OpenAI) -> None:
    """OpenAI: parameters left out define a function of no arguments, so its arguments are {}."""
    tick = {"type": "function", "function": {"name": "tick"}}
    answer = create(tool_client, tools=[tick], tool_choice={"type": "function", "function": {"name": "tick"}})
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "tick" and json.loads(call.function.arguments) == {}


def test_calls_cut_by_a_stop_string_do_not_finish_as_tool_calls(tool_client: openai.OpenAI) -> None:
    """A stop string ends the constrained output midway: the reply keeps finish_reason stop and names the
    string, since the last call's arguments are no whole JSON object (max_tokens gives length the same way)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        if stream:
            _, _, finish = streamed_calls(tool_client, tools=TOOLS, tool_choice=named, stop=[","])
        else:
            answer = create(tool_client, tools=TOOLS, tool_choice=named, stop=[","])
            finish = answer.choices[0].finish_reason
            assert answer.choices[0].stop_reason == ","
        assert finish == "stop", stream
