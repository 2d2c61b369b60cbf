"""The pythonic tool-call format: a Python list of keyword calls read with ``ast``, Llama 4's wrapper, the same calls
streamed in any pieces as whole, text that is no list of calls kept as content, hostile Python kept harmless."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvserve
from kvserve.server.pythonic_tool_parser import PythonicToolCallParser, read_call
from kvserve.server.tool_parsers import ParsedDelta, fold, parse_tool_calls
from tests.server.test_tool_parsers import calls_of, fed_in_pieces

# each value as Python writes it, and the JSON its call's arguments hold
ARGUMENTS = [
    ('city="San Francisco", metric="celsius"', {"city": "San Francisco", "metric": "celsius"}),
    ("q='a ) b ] c , d', r=\"it's\", s='say \"hi\"'", {"q": "a ) b ] c , d", "r": "it's", "s": 'say "hi"'}),
    (r"q='back\\slash \' quote \n newline \t tab \u00e9', r=r'raw \d'",
     {"q": "back\\slash ' quote \n newline \t tab é", "r": "raw \\d"}),
    ("q='''triple ' and '' inside''', r=\"\"\"and \" \"\" here\"\"\"", {"q": "triple ' and '' inside",
                                                                       "r": 'and " "" here'}),
    ("n=1, f=-2.5e3, t=True, no=False, none=None, big=12345678901234567890",
     {"n": 1, "f": -2500.0, "t": True, "no": False, "none": None, "big": 12345678901234567890}),
    ("deep={'a': [1, (2, 3), {'b': {'c': ['x)]', None]}}], 2: 'int key'}, empty=[]",
     {"deep": {"a": [1, [2, 3], {"b": {"c": ["x)]", None]}}], "2": "int key"}, "empty": []}),
    ("u='ünïcödé 漢字 🙂'", {"u": "ünïcödé 漢字 🙂"}),
    ("", {}),
]
CALLS = "[" + ", ".join(f"get{i}({source})" for i, (source, _) in enumerate(ARGUMENTS)) + "]"
EXPECTED = [(f"get{i}", value) for i, (_, value) in enumerate(ARGUMENTS)]
TEXTS = [
    CALLS,
    f"<|python_start|>{CALLS}<|python_end|>",
    f"\n  {CALLS}\n\nDone, as asked.\n",
    "[get_weather(city='Oslo'),\n get_time()]",
    "[get_weather(city='Oslo'), get_weather(city=x)]",  # a second element that is no call
    "[get_weather(city=x), get_time()]",  # a first one
    "I would call [get_weather(city='Oslo')] here.",
    "<|python_start|>print('hi')<|python_end|>",
    "[get_weather(city='Oslo'",  # cut short
    "[1, 2, 3] are numbers",
]


def streamed(text: str, cuts: list[int], parser: PythonicToolCallParser | None = None) -> tuple[str, list]:
    return fed_in_pieces(parser or PythonicToolCallParser(), text, cuts)


def whole(text: str, **options) -> tuple[str, list]:
    return parse_tool_calls(PythonicToolCallParser(**options), text)


def test_every_kind_of_literal_is_read_into_json_arguments() -> None:
    content, calls = whole(CALLS)
    assert calls_of((content, calls)) == EXPECTED and content == ""
    assert len({c.id for c in calls}) == len(calls)
    assert calls[6].arguments == '{"u": "ünïcödé 漢字 🙂"}'  # as the model wrote it, not \u-escaped


@settings(max_examples=80, deadline=None)
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(0, 700), max_size=40))
def test_streaming_in_any_pieces_gives_the_whole_texts_content_and_calls(text: str, cuts: list[int]) -> None:
    parser, other = PythonicToolCallParser(), PythonicToolCallParser()
    at_once = parse_tool_calls(parser, text)
    pieces = streamed(text, cuts, other)
    assert calls_of(pieces) == calls_of(at_once) and pieces[0] == at_once[0]
    assert (other.num_calls, other.num_invalid) == (parser.num_calls, parser.num_invalid)


@pytest.mark.parametrize("text", TEXTS)
def test_a_character_at_a_time_gives_the_whole_texts_content_and_calls(text: str) -> None:
    pieces = streamed(text, list(range(len(text))))
    assert calls_of(pieces) == calls_of(whole(text)) and pieces[0] == whole(text)[0]


def test_llama4s_wrapper_and_the_text_after_the_list() -> None:
    assert calls_of(whole(TEXTS[1])) == EXPECTED and whole(TEXTS[1])[0] == ""
    content, calls = whole("<|python_start|> [f(a=1)] <|python_end|>  \n")
    assert (content, calls_of((content, calls))) == ("", [("f", {"a": 1})])
    assert whole(TEXTS[2])[0] == "\n\nDone, as asked.\n"  # leading and trailing whitespace of the calls is not content
    assert whole("[f()]\n<|python_e")[0] == "\n<|python_e"  # a cut end marker is the model's text
    parser = PythonicToolCallParser()
    assert parser.feed("[f()]").tool_calls and parser.feed("\n\n").content == ""  # may be the end
    assert parser.feed("Done.").content == "\n\nDone." and parser.feed("\n").content == "\n"  # text: said as it comes


def test_several_calls_and_max_calls() -> None:
    text = "[f(a=1), g(b=[1, 2]), f(a=3)]"
    assert calls_of(whole(text)) == [("f", {"a": 1}), ("g", {"b": [1, 2]}), ("f", {"a": 3})]
    parser = PythonicToolCallParser(max_calls=1)
    assert calls_of(parse_tool_calls(parser, text)) == [("f", {"a": 1})] and parser.num_invalid == 0
    parser = PythonicToolCallParser()
    assert calls_of(parse_tool_calls(parser, "[f(a=1),]")) == [("f", {"a": 1})]  # a trailing comma, as in Python
    assert parser.num_invalid == 0


def test_a_call_is_said_whole_when_the_element_closes_and_a_possible_start_waits() -> None:
    parser = PythonicToolCallParser()
    assert parser.feed("<|python_sta") == ParsedDelta() and parser.feed("rt|>[get_") == ParsedDelta()
    assert parser.feed("weather(city='Oslo')") == ParsedDelta()  # a call closes at the "," or "]" after it
    said = parser.feed(", get_time(")
    assert [(d.name, d.arguments) for d in said.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
    assert said.tool_calls[0].id and said.content == "" and parser.num_calls == 1
    assert parser.feed("a='''x''")  == ParsedDelta()  # quotes that may be a triple's end wait too
    assert [d.arguments for d in parser.feed("')]").tool_calls] == ['{"a": "x"}']


NOT_CALLS = [
    "[get_weather('Oslo')]",  # positional
    "[get_weather(city, unit='c')]",
    "[get_weather(*cities)]",
    "[get_weather(**{'city': 'Oslo'})]",
    "[get_weather(city=oslo)]",  # a name
    "[get_weather(city=f'{x}')]",  # an f-string
    "[get_weather(city=lookup('Oslo'))]",  # a call as a value
    "[get_weather(city='Os' + 'lo')]",
    "[get_weather(n=2**10**10)]",  # never evaluated
    "[get_weather(city='Oslo', city='Bergen')]",  # a repeated keyword, as Python refuses it
    "[tools.get_weather(city='Oslo')]",
    "[get_weather(city='Oslo') + 1]",
    "[get_weather(city='Oslo')) ]",
    "[get_weather(s={1, 2})]",  # values JSON cannot hold
    "[get_weather(b=b'x')]",
    "[get_weather(c=1+2j)]",
    "[get_weather(x=1e999)]",
    "[get_weather(d={(1, 2): 3})]",
    "[get_weather(d={[1]: 2})]",
    "[get_weather(city='Oslo')",  # never closed
    "[]",
    "[,]",
    "[get_weather(city='Oslo') get_time()]",
    "Let me check: [get_weather(city='Oslo')]",  # calls open only at the start
    "<|python_start|>get_weather(city='Oslo')<|python_end|>",
    "get_weather(city='Oslo')",
    "[get_weather(city='Oslo\x00')]",
]


@pytest.mark.parametrize("text", NOT_CALLS)
def test_text_that_is_no_list_of_calls_is_content_as_written(text: str) -> None:
    assert whole(text) == (text, [])
    assert streamed(text, list(range(len(text)))) == (text, [])


def test_an_element_after_a_call_that_is_no_call_counts_as_invalid() -> None:
    """The chat server then answers the whole output as content (a stream has said the call before it)."""
    for bad in NOT_CALLS[:19]:
        element = bad[1:-1]
        parser = PythonicToolCallParser()
        assert calls_of(parse_tool_calls(parser, f"[get_time(), {element}]")) == [("get_time", {})]
        assert parser.num_invalid == 1, element
    parser = PythonicToolCallParser()
    assert calls_of(parse_tool_calls(parser, "[get_time(), get_weather(city='Os")) == [("get_time", {})]
    assert parser.num_invalid == 1  # a list the output ended inside


class _OnlyWeather:
    """A request that declares get_weather alone, strict: its arguments must hold a string "city"."""

    def knows(self, name: str) -> bool:
        return name == "get_weather"

    def accepts(self, name: str, arguments: dict) -> bool:
        return isinstance(arguments.get("city"), str)


def test_a_call_the_check_refuses_is_no_call() -> None:
    for text in ("[get_time()]", "[get_weather(city=7)]"):
        parser = PythonicToolCallParser(check=_OnlyWeather())
        assert parse_tool_calls(parser, text) == (text, []) and parser.num_invalid == 1
    parser = PythonicToolCallParser(check=_OnlyWeather())
    assert calls_of(parse_tool_calls(parser, "[get_weather(city='Oslo'), get_time()]")) == [
        ("get_weather", {"city": "Oslo"})]
    assert parser.num_invalid == 1


HOSTILE = {
    "brackets nested past the parser's limit": "[f(a=" + "[" * 100_000 + "]" * 100_000 + ")]",
    "a unary chain past the parser's stack": "[f(a=" + "-" * 100_000 + "1)]",
    "a unary chain past the recursion limit": "[f(a=" + "-" * 3_000 + "1)]",
    "a chain of nots": "[f(a=" + "not " * 50_000 + "1)]",
    "a chain of additions": "[f(a=" + "1+" * 100_000 + "1)]",
    "a chain of attributes": "[f(a=" + "x." * 100_000 + "y)]",
    "calls nested deep": "[f(a=" + "g(" * 50_000 + ")" * 50_000 + ")]",
    "a decimal integer past the conversion limit": "[f(a=1" + "0" * 5_000 + ")]",
    "a hex integer JSON cannot write": "[f(a=0x" + "f" * 100_000 + ")]",
    "a power never computed": "[f(a=9**9**9**9)]",
    "an open string never closed": "[f(a='" + "x" * 100_000,
    "quotes in thousands": "[f(a=" + "''" * 50_000 + ")]",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_python_is_content_quickly_and_never_raises(name: str) -> None:
    text = HOSTILE[name]
    start = time.monotonic()
    assert whole(text) == (text, [])
    parser = PythonicToolCallParser()
    assert calls_of(parse_tool_calls(parser, "[g(), " + text[1:])) == [("g", {})] and parser.num_invalid == 1
    assert streamed(text, list(range(0, len(text), 997))) == (text, [])
    assert time.monotonic() - start < 5, "a hostile input took too long"


def test_values_within_pythons_limits_are_read() -> None:
    """Nesting up to the parser's limit, and the largest integers JSON can write, are arguments like any."""
    nested = "[" * 150 + "]" * 150
    assert read_call(f"f(a={nested}, b=1{'0' * 4_000})") == ("f", f'{{"a": {nested}, "b": 1{"0" * 4_000}}}')


# ---- through the HTTP app: a scripted model-free engine whose chat template asks for pythonic calls ----

SCRIPT = "<|python_start|>[get_weather(city='Oslo', days=[1, 2]), get_time(zone=\"Europe/Oslo\")]<|python_end|>"
SCRIPT_CALLS = [("get_weather", {"city": "Oslo", "days": [1, 2]}), ("get_time", {"zone": "Europe/Oslo"})]
TOOL_NAMES = ("get_weather", "get_time")
CHAT_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in TOOL_NAMES]
TEMPLATE = "{% if tools %}[func_name1(params_name1=params_value1...)]{% endif %}{{ messages }}"
USER = [{"role": "user", "content": "Weather and time in Oslo?"}]


@pytest.fixture(scope="module")
def pythonic_server():
    from tests.server.test_app_fake_engine import InProcessServer
    from tests.server.test_reasoning import ScriptedEngine

    engine = ScriptedEngine(SCRIPT)
    engine.input_processor.chat_template = lambda tools=None: TEMPLATE  # --tool-call-parser auto reads it
    server = InProcessServer(fake=engine)
    yield server
    server.stop()


def post(server, path: str, body: dict) -> dict:
    import httpx

    answer = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def events(server, path: str, body: dict) -> list[dict]:
    import httpx

    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=30) as answer:
        return [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]


def test_pythonic_calls_come_out_of_chat_completions_whole_and_streamed(pythonic_server) -> None:
    body = {"model": "fake", "messages": USER, "tools": CHAT_TOOLS}
    choice = post(pythonic_server, "/v1/chat/completions", body)["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == SCRIPT_CALLS
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    chunks = [c["choices"][0] for c in events(pythonic_server, "/v1/chat/completions", body) if c["choices"]]
    pieces: dict[int, dict] = {}
    for delta in (c["delta"] for c in chunks):
        assert not delta.get("content")
        for piece in delta.get("tool_calls") or []:
            call = pieces.setdefault(piece["index"], {"name": piece["function"].get("name"), "arguments": ""})
            call["arguments"] += piece["function"].get("arguments") or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in pieces.values()] == SCRIPT_CALLS
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_pythonic_calls_come_out_of_responses_and_messages(pythonic_server) -> None:
    tools = [{"type": "function", "name": name, "parameters": {"type": "object"}} for name in TOOL_NAMES]
    body = {"model": "fake", "input": USER, "tools": tools}
    output = post(pythonic_server, "/v1/responses", body)["output"]
    assert [(i["type"], i["name"], json.loads(i["arguments"])) for i in output] == [
        ("function_call", *call) for call in SCRIPT_CALLS]
    final = events(pythonic_server, "/v1/responses", body)[-1]["response"]
    assert [(i["name"], json.loads(i["arguments"])) for i in final["output"]] == SCRIPT_CALLS
    body = {"model": "fake", "max_tokens": 200, "messages": USER,
            "tools": [{"name": name, "input_schema": {"type": "object"}} for name in TOOL_NAMES]}
    message = post(pythonic_server, "/v1/messages", body)
    assert [(b["type"], b["name"], b["input"]) for b in message["content"]] == [("tool_use", *c) for c in SCRIPT_CALLS]
    assert message["stop_reason"] == "tool_use"
    streamed = events(pythonic_server, "/v1/messages", body)
    starts = [e["content_block"] for e in streamed if e["type"] == "content_block_start"]
    assert [(b["type"], b["name"]) for b in starts] == [("tool_use", name) for name in TOOL_NAMES]
    inputs = [e["delta"]["partial_json"] for e in streamed if e.get("delta", {}).get("type") == "input_json_delta"]
    assert [json.loads(i) for i in inputs] == [arguments for _, arguments in SCRIPT_CALLS]
    assert [e["delta"]["stop_reason"] for e in streamed if e["type"] == "message_delta"] == ["tool_use"]


def test_a_list_that_is_no_call_is_the_answers_content_whole_and_streamed(pythonic_server, monkeypatch) -> None:
    text = "[get_weather(city=oslo)]"
    monkeypatch.setattr(pythonic_server.fake, "script", text.encode())
    body = {"model": "fake", "messages": USER, "tools": CHAT_TOOLS}
    choice = post(pythonic_server, "/v1/chat/completions", body)["choices"][0]
    assert choice["message"]["content"] == text and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
    chunks = [c["choices"][0] for c in events(pythonic_server, "/v1/chat/completions", body) if c["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == text
    assert not any(c["delta"].get("tool_calls") for c in chunks) and chunks[-1]["finish_reason"] == "stop"


def test_an_invalid_escape_is_read_as_python_reads_it_under_w_error() -> None:
    """Python warns of "\\d" (a DeprecationWarning, a SyntaxWarning from 3.12): a process run with warnings made
    errors (``-W error``) must not make a Windows path no call."""
    script = "from kvserve.server.pythonic_tool_parser import read_call; print(read_call(r\"f(path='C:\\dir')\"))"
    run = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(kvserve.__file__).parents[1])})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == repr(("f", r'{"path": "C:\\dir"}'))


def test_a_parse_leaves_the_processs_warning_filters_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Swapped for the parse (``catch_warnings``), they would be swapped under other threads too: two parses at
    once, in the event loop and a worker thread, could leave every warning of the process ignored."""
    seen = []

    def parse(*args: Any, **kwargs: Any) -> ast.AST:
        seen.append(list(warnings.filters))
        return real_parse(*args, **kwargs)

    real_parse = ast.parse
    monkeypatch.setattr(ast, "parse", parse)
    assert read_call("f(a=1)") == ("f", '{"a": 1}')
    assert seen == [list(warnings.filters)]


@pytest.mark.parametrize("before, after", [("", "[f()]"), ("[f()]", ""), ("<|python_start|>[f()]", "<|python_end|>")])
def test_a_long_run_of_blank_lines_streams_in_linear_time(before: str, after: str) -> None:
    """Whitespace that may yet be no content (before the list, after the calls) is read once: rescanned at each
    delta, 40,000 deltas of it took 12 s."""
    parser = PythonicToolCallParser()
    deltas = parser.feed(before)
    start = time.monotonic()
    for _ in range(40_000):
        deltas.extend(parser.feed("\n\n\n\n"))
    assert time.monotonic() - start < 3
    deltas.extend(parser.feed(after))
    deltas.extend(parser.finish())
    assert fold(deltas)[0] == "" and [c.name for c in fold(deltas)[1]] == ["f"]
