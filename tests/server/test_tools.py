"""What tool_choice does to a request (the grammar of required and named calls) and how tool conversations
reach chat templates, with and without their own tool support."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from tokenizers import AddedToken
from transformers import AutoTokenizer

from kvserve.engine.input_processor import InputProcessor
from kvserve.sample.grammar import StructuredOutputCompiler
from kvserve.server.tool_parsers import FORMATS
from kvserve.server.tools import needs_special_tokens, tool_call_format, tool_constraint
from tests.engine.byte_bpe import byte_bpe_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
# A template of our own that renders tools, in the shape tool-aware templates (Qwen, Hermes) have.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}{{ c.function.arguments | tojson }}</call>"
    "{% endfor %}{% endfor %}<tool_call>"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def matcher_accepts(tokenizer, constraint, text: str) -> bool:
    import xgrammar

    compiled = StructuredOutputCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(constraint)
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def test_required_constrains_to_an_array_of_valid_calls(tokenizer) -> None:
    constraint = tool_constraint([WEATHER, TIME], "required", parallel_tool_calls=True)
    assert constraint is not None and isinstance(constraint.json, dict)
    two = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(two, constraint.json)
    assert matcher_accepts(tokenizer, constraint, json.dumps(two))
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "Rome"}}], [{"name": "nope", "parameters": {}}]):
        assert not matcher_accepts(tokenizer, constraint, json.dumps(bad))
    single = tool_constraint([WEATHER, TIME], "required", parallel_tool_calls=False)
    assert single is not None and not matcher_accepts(tokenizer, single, json.dumps(two))


def test_a_named_function_constrains_to_its_parameters_and_auto_to_nothing(tokenizer) -> None:
    named = tool_constraint([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, True)
    assert named is not None and named.json == WEATHER["function"]["parameters"]
    assert matcher_accepts(tokenizer, named, '{"city": "Paris"}')
    assert tool_constraint([WEATHER], "auto", True) is None and tool_constraint([WEATHER], "none", True) is None


def test_the_call_format_follows_the_template() -> None:
    assert tool_call_format("auto", None) is FORMATS["hermes"]
    assert tool_call_format("mistral", "no tool support here") is FORMATS["hermes"]  # kvserve describes them
    assert tool_call_format("auto", "{{ tools }} [TOOL_CALLS]") is FORMATS["mistral"]
    assert tool_call_format("auto", "{{ tools }} <|python_tag|>") is FORMATS["llama3_json"]
    assert tool_call_format("llama3_json", "{{ tools }}") is FORMATS["llama3_json"]
    assert tool_call_format("pythonic", "{{ tools }}") is FORMATS["pythonic"]


# How templates write an earlier call back, and what they tell the model: the pythonic ones (vLLM's Llama 3.2, Llama 4
# and ToolACE templates, Meta's Llama 4 prompt format) and the JSON ones (Llama 3.1 / 3.2 / 4, Hermes / Qwen, Mistral).
PYTHONIC_TEMPLATE_LINES = [
    "{{- tool_call.name + '(' -}}",
    "{{- tool_call.function.name ~ \"(\" -}}",
    "'Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), '",
]
JSON_TEMPLATE_LINES = [
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}",
    "{{- '{\"name\": \"' + tool_call.function.name + '\", ' }} <|python_start|>",
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}",
    "'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.'",
    "{{- \"[TOOL_CALLS][\" }}{{- tool_call.function.name|tojson }}",
    "{%- for tool in tools %}{{ tool.function.name }}({{ tool.function.parameters | tojson }}){% endfor %}",
]


@pytest.mark.parametrize("line", PYTHONIC_TEMPLATE_LINES)
def test_auto_reads_the_pythonic_format_off_the_templates_own_text(line: str) -> None:
    assert tool_call_format("auto", "{% if tools %}" + line) is FORMATS["pythonic"]


@pytest.mark.parametrize("line", JSON_TEMPLATE_LINES)
def test_auto_takes_no_json_template_for_pythonic(line: str) -> None:
    """Llama 4's <|python_start|> is no evidence: the token wraps plain code too, whatever the call format."""
    assert tool_call_format("auto", "{% if tools %}" + line) is not FORMATS["pythonic"]


def test_a_template_that_takes_tools_receives_them(tokenizer) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = TOOLS_TEMPLATE
    processor = InputProcessor(tokenizer, len(tokenizer), max_model_len=512)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {}}}]}]
    prompt = processor.apply_chat_template(conversation, tools=[WEATHER, TIME])["prompt"]
    assert prompt.startswith("<tools>get_weather;get_time;</tools><user>hi") and "<call>get_time{}</call>" in prompt


def test_a_marker_that_is_a_special_added_token_keeps_special_tokens_in_the_text() -> None:
    """Mistral's [TOOL_CALLS] is an added token flagged special: decoding with special tokens skipped drops it, so
    the calls would come back as content. transformers 5's ``all_special_tokens`` does not list such tokens."""
    tok = copy.deepcopy(byte_bpe_tokenizer())
    tok.backend_tokenizer.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    assert "[TOOL_CALLS]" not in tok.all_special_tokens
    assert needs_special_tokens(FORMATS["mistral"], tok)
    assert not needs_special_tokens(FORMATS["mistral"], byte_bpe_tokenizer())  # a plain text marker stays


class City(BaseModel):
    name: str
    country: Literal["FR", "NO"]


class Trip(BaseModel):
    start: City
    stops: list[City]


def test_required_takes_functions_whose_parameters_refer_to_their_definitions(tokenizer) -> None:
    """pydantic (and the openai SDK's ``pydantic_function_tool``) write a nested model as ``$defs`` and a
    ``#/$defs/...`` reference, which resolves from the schema's root: inside the array of calls each function's
    definitions move to the root, and its references with them, including one to its parameters' own root."""
    trip = openai.pydantic_function_tool(Trip, name="plan_trip")
    assert "$defs" in trip["function"]["parameters"]
    node = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object",
        "properties": {"label": {"type": "string"}, "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["label", "child"], "additionalProperties": False}}}
    constraint = tool_constraint([WEATHER, trip, node], "required", parallel_tool_calls=True)
    assert constraint is not None and isinstance(constraint.json, dict)
    paris = {"name": "Paris", "country": "FR"}
    calls = [{"name": "plan_trip", "parameters": {"start": paris, "stops": [{"name": "Oslo", "country": "NO"}]}},
             {"name": "tree", "parameters": {"label": "a", "child": {"label": "b", "child": None}}}]
    jsonschema.validate(calls, constraint.json)
    assert matcher_accepts(tokenizer, constraint, json.dumps(calls))
    wrong_country = [{"name": "plan_trip", "parameters": {"start": {**paris, "country": "IT"}, "stops": []}}]
    assert not matcher_accepts(tokenizer, constraint, json.dumps(wrong_country))
    assert trip["function"]["parameters"]["properties"]["start"] == {"$ref": "#/$defs/City"}  # the request's own


def test_moving_definitions_keeps_what_the_schema_means(tokenizer) -> None:
    """A name in both ``$defs`` and ``definitions`` stays two definitions; a ``"$ref"`` inside data (a const, a
    property named ``default``) is no reference and stays as written; definitions that are not an object are left
    for the compiler to refuse (a 400), not a crash."""
    parameters = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/X"}, "b": {"$ref": "#/definitions/X"},
                       "c": {"const": {"$ref": "#/$defs/X"}}, "default": {"$ref": "#/$defs/X"}},
        "required": ["a", "b", "c", "default"], "additionalProperties": False,
        "$defs": {"X": {"type": "integer"}}, "definitions": {"X": {"type": "string"}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    constraint = tool_constraint([tool], "required", parallel_tool_calls=True)
    assert constraint is not None and isinstance(constraint.json, dict)
    call = [{"name": "f", "parameters": {"a": 1, "b": "x", "c": {"$ref": "#/$defs/X"}, "default": 2}}]
    jsonschema.validate(call, constraint.json)
    for wrong in ({"a": "x"}, {"b": 1}, {"c": {"$ref": "#/$defs/0.$defs.X"}}, {"default": "x"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "f", "parameters": {**call[0]["parameters"], **wrong}}], constraint.json)
    # what the grammar writes (xgrammar writes a const object without spaces, so c is left out here)
    del parameters["properties"]["c"], call[0]["parameters"]["c"]
    parameters["required"].remove("c")
    constraint = tool_constraint([tool], "required", parallel_tool_calls=True)
    assert constraint is not None and matcher_accepts(tokenizer, constraint, json.dumps(call))
    for wrong in ({"a": "x"}, {"b": 1}, {"default": "x"}):
        bad = [{"name": "f", "parameters": {**call[0]["parameters"], **wrong}}]
        assert not matcher_accepts(tokenizer, constraint, json.dumps(bad))
    odd = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "$defs": ["x"]}}}
    constraint = tool_constraint([odd], "required", parallel_tool_calls=True)
    assert constraint is not None and constraint.json["items"]["anyOf"][0]["properties"]["parameters"]["$defs"] == ["x"]
