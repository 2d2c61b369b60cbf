"""Tool-call parsing: every format, adversarial arguments, and the same calls whether the text arrives whole
or in pieces of any size."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.server.tool_parsers import (
    FORMATS,
    REQUIRED_FORMAT,
    NamedToolCallParser,
    OutputParser,
    ParsedDelta,
    ToolCallFormat,
    ToolCallParser,
    fold,
    parse_tool_calls,
)

ADVERSARIAL_ARGUMENTS = [
    {"q": "a } b { c"},
    {"q": "</tool_call> and [TOOL_CALLS] and <|python_tag|> inside"},
    {"q": "quote \" backslash \\ newline \n tab \t"},
    {"q": "ünïcödé 漢字 🙂", "n": [1, 2.5, -3e2, True, None]},
    {"nested": {"deep": [{"x": "}}]]"}], "empty": {}}},
    {"long": "x" * 5000},
    {},
]


def hermes(calls: list[tuple[str, dict]], before: str = "", between: str = "\n") -> str:
    blocks = [f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, ensure_ascii=False)}\n</tool_call>'
              for n, a in calls]
    return before + between.join(blocks)


TEXTS = {
    "hermes": hermes([("get", a) for a in ADVERSARIAL_ARGUMENTS], before="Let me look.\n"),
    "llama3_json": "<|python_tag|>" + "; ".join(json.dumps({"name": "get", "parameters": a}, ensure_ascii=False)
                                                  for a in ADVERSARIAL_ARGUMENTS),
    "mistral": "[TOOL_CALLS]" + json.dumps([{"name": "get", "arguments": a} for a in ADVERSARIAL_ARGUMENTS],
                                           ensure_ascii=False),
}


def streamed(fmt: ToolCallFormat, text: str, cuts: list[int]) -> tuple[str, list]:
    return fed_in_pieces(ToolCallParser(fmt), text, cuts)


def fed_in_pieces(parser: OutputParser, text: str, cuts: list[int]) -> tuple[str, list]:
    """The content and calls ``parser`` says of ``text`` fed cut at ``cuts``, then finished."""
    deltas = ParsedDelta()
    start = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        deltas.extend(parser.feed(text[start:cut]))
        start = max(start, cut)
    deltas.extend(parser.finish())
    return fold(deltas)


def calls_of(result: tuple[str, list]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in result[1]]


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_every_format_reads_adversarial_arguments_exactly(name: str) -> None:
    content, calls = parse_tool_calls(ToolCallParser(FORMATS[name]), TEXTS[name])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get", a) for a in ADVERSARIAL_ARGUMENTS]
    assert content.strip() == ("Let me look." if name == "hermes" else "")
    assert len({c.id for c in calls}) == len(calls)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(TEXTS)), cuts=st.lists(st.integers(0, 6000), max_size=40))
def test_streaming_in_any_pieces_gives_the_whole_texts_calls(name: str, cuts: list[int]) -> None:
    text = TEXTS[name]
    whole = parse_tool_calls(ToolCallParser(FORMATS[name]), text)
    pieces = streamed(FORMATS[name], text, cuts)
    assert calls_of(pieces) == calls_of(whole)
    assert pieces[0] == whole[0]


@pytest.mark.parametrize("name, text", [
    ("hermes", hermes([("get", {})]) + " Done.\n"),
    ("hermes", hermes([("get", {})]) + "\n\nDone.\n\n" + hermes([("get", {"a": 1})]) + "\n"),
    ("mistral", '[TOOL_CALLS][{"name": "get", "arguments": {}}] Done.\n \n'),
    ("llama3_json", '{"name": "get", "parameters": {}} Done.\n'),
])
def test_whitespace_after_the_text_that_follows_calls_is_content_streamed_as_whole(name: str, text: str) -> None:
    """Whitespace right after a call is no content; after text that follows the calls it is that text's: held at
    each delta (more text might follow) and dropped at the end, a stream lost it where the whole answer kept it."""
    content, calls = parse_tool_calls(ToolCallParser(FORMATS[name]), text)
    assert content.rstrip(" \n").endswith("Done.") and content.endswith("\n")
    for cuts in ([], list(range(1, len(text))), [len(text) - 1]):
        pieces = streamed(FORMATS[name], text, cuts)
        assert (pieces[0], calls_of(pieces)) == (content, calls_of((content, calls))), cuts


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get", "arguments": {"city": "x"}, "name": "other"}</tool_call>',
    '<tool_call>{"name": "get", "arguments": {"city": "x"}, "arguments": {"city": 2}}</tool_call>',
])
@pytest.mark.parametrize("cuts", [[], list(range(1, 90)), [30, 60]])
def test_a_repeated_key_gives_the_same_call_streamed_and_whole(text: str, cuts: list[int]) -> None:
    """The whole answer took the repeat (as json.loads does), a stream the first it saw."""
    whole = parse_tool_calls(ToolCallParser(FORMATS["hermes"]), text)
    assert calls_of(streamed(FORMATS["hermes"], text, cuts)) == calls_of(whole) == [("get", {"city": "x"})]


def test_a_repeated_key_is_checked_as_the_call_is_said() -> None:
    """The check read the repeat (json.loads keeps a key's last value) where the call said the first: a strict
    call's bad arguments went out as a call, and good ones were made content."""
    class Strict:
        def knows(self, name: str) -> bool:
            return name == "get"

        def accepts(self, name: str, arguments: dict) -> bool:
            return isinstance(arguments.get("city"), str)

    good_first = '<tool_call>{"name": "get", "arguments": {"city": "x"}, "arguments": {"city": 2}}</tool_call>'
    bad_first = '<tool_call>{"name": "get", "arguments": {"city": 2}, "arguments": {"city": "x"}}</tool_call>'
    for text, arguments, invalid in ((good_first, {"city": "x"}, 0), (bad_first, {"city": 2}, 1)):
        parser = ToolCallParser(FORMATS["hermes"], check=Strict())
        assert calls_of(parse_tool_calls(parser, text)) == [("get", arguments)]
        assert parser.num_invalid == invalid  # the chat server answers an invalid call's whole text as content


def test_arguments_stream_as_they_are_written() -> None:
    parser = ToolCallParser(FORMATS["hermes"])
    first = parser.feed('<tool_call>{"name": "f", "arguments": {"city": "Pa')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("f", ""), (None, '{"city": "Pa')]
    second = parser.feed('ris"}}</tool_call>')
    assert "".join(d.arguments for d in second.tool_calls) == 'ris"}'
    assert parser.num_calls == 1


@pytest.mark.parametrize("text", [
    "plain text with a < and a <tool in it",
    "<tool_call> this is no JSON",
    '<tool_call>{"no_name": 1}</tool_call>',
])
def test_text_that_is_not_a_call_is_content(text: str) -> None:
    content, calls = parse_tool_calls(ToolCallParser(FORMATS["hermes"]), text)
    assert calls == [] and content == text


def test_llama3_reads_calls_only_at_the_start() -> None:
    text = 'Sure: {"name": "f", "parameters": {}}'
    assert parse_tool_calls(ToolCallParser(FORMATS["llama3_json"]), text) == (text, [])
    _, calls = parse_tool_calls(ToolCallParser(FORMATS["llama3_json"]), ' {"name": "f", "parameters": {"a": 1}}')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]


def test_a_call_without_arguments_gets_an_empty_object_and_max_calls_drops_the_rest() -> None:
    text = hermes([("a", {}), ("b", {"x": 1})]).replace(', "arguments": {}', "")
    _, calls = parse_tool_calls(ToolCallParser(FORMATS["hermes"], max_calls=1), text)
    assert [(c.name, c.arguments) for c in calls] == [("a", "{}")]


def test_a_call_cut_short_keeps_what_was_written() -> None:
    content, calls = parse_tool_calls(ToolCallParser(FORMATS["hermes"]), '<tool_call>{"name": "f", "arguments": {"a"')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a"')]


def test_the_required_array_and_a_named_function() -> None:
    text = json.dumps([{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}])
    assert calls_of(parse_tool_calls(ToolCallParser(REQUIRED_FORMAT), text)) == [("f", {"a": 1}), ("g", {})]
    assert calls_of(parse_tool_calls(NamedToolCallParser("f"), '{"a": 1}')) == [("f", {"a": 1})]


def test_a_named_function_with_no_output_made_no_call() -> None:
    """An output cut before its answer (in its thinking) reports no call with empty arguments, as required's."""
    assert parse_tool_calls(NamedToolCallParser("f"), "") == ("", [])
    parser = NamedToolCallParser("f")
    assert not parser.feed("").tool_calls and not parser.finish().tool_calls and parser.num_calls == 0


@pytest.mark.parametrize("call", [
    '{"name": "f", "arguments": "x"}',  # arguments that are no object
    '{"name": "f", "arguments": {"a": }',  # no JSON, and never closed
    '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}",  # nested past Python's recursion limit
])
def test_a_call_that_is_no_json_object_counts_as_invalid(call: str) -> None:
    """The chat server answers such an output as text (a stream does not finish as tool_calls)."""
    parser = ToolCallParser(FORMATS["hermes"])
    parse_tool_calls(parser, f"<tool_call>\n{call}\n</tool_call>")
    assert parser.num_invalid == 1


class _OnlyF:
    """A request that declares f alone, whose arguments must hold "a"."""

    def knows(self, name: str) -> bool:
        return name == "f"

    def accepts(self, name: str, arguments: dict) -> bool:
        return "a" in arguments


def test_a_call_the_check_refuses_is_no_call() -> None:
    """An undeclared function's call is content whole and streamed (its name is never said) and counts as invalid
    (the chat server then answers the whole text); so does a declared one whose arguments the check refuses,
    whose name was said."""
    undeclared = hermes([("g", {"a": 1})])
    for cuts in ([], list(range(len(undeclared)))):
        parser = ToolCallParser(FORMATS["hermes"], check=_OnlyF())
        deltas = ParsedDelta()
        start = 0
        for cut in cuts + [len(undeclared)]:
            deltas.extend(parser.feed(undeclared[start:cut]))
            start = cut
        deltas.extend(parser.finish())
        assert fold(deltas) == (undeclared, []) and parser.num_invalid == 1
    parser = ToolCallParser(FORMATS["hermes"], check=_OnlyF())
    assert calls_of(parse_tool_calls(parser, hermes([("f", {"b": 1})]))) == [("f", {"b": 1})]
    assert parser.num_invalid == 1
    parser = ToolCallParser(FORMATS["hermes"], check=_OnlyF())
    beside = hermes([("f", {"a": 1}), ("g", {})])  # beside a declared call: the whole answer is the model's text
    assert calls_of(parse_tool_calls(parser, beside)) == [("f", {"a": 1})] and parser.num_invalid == 1
    mistral = "[TOOL_CALLS]" + json.dumps([{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}])
    parser = ToolCallParser(FORMATS["mistral"], check=_OnlyF())
    assert calls_of(parse_tool_calls(parser, mistral)) == [("f", {"a": 1})] and parser.num_invalid == 1


@pytest.mark.parametrize("between", ["\n", " \n\n ", ""])
def test_whitespace_between_and_after_calls_is_no_content(between: str) -> None:
    """OpenAI answers calls without content; text before the first call and after the last is content."""
    text = hermes([("f", {"a": 1}), ("f", {"a": 2})], before="Checking.\n", between=between) + "\n"
    content, calls = streamed(FORMATS["hermes"], text, list(range(len(text))))
    assert (content, len(calls)) == ("Checking.\n", 2)
    assert parse_tool_calls(ToolCallParser(FORMATS["hermes"]), text + " done")[0] == "Checking.\n\n done"
