"""The text a request's prefix is keyed on, read from its body: the prompt or the chat messages, leniently (a
field of the wrong type, or a body that is no JSON object, is no text: the replica refuses it), and only as much
of it as is keyed."""

from __future__ import annotations

import pytest

from kvserve.router.prefix_index import MAX_KEYED_CHARS
from kvserve.router.prompts import prompt_text, request_payload, request_text


@pytest.mark.parametrize("payload, text", [
    ({"prompt": "abc"}, "abc"),
    ({"prompt": [1, 2]}, "[1, 2]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "user:hi"),
    ({"messages": [{"role": 5, "content": [{"type": "text", "text": None}, {"text": 5}, "x"]}]}, ":"),
    ({"prompt": {"not": "a prompt"}}, ""),
    # a replica shares blocks only between requests of one cache_salt: the salt leads the key
    ({"prompt": "abc", "cache_salt": "t1"}, "cache_salt:t1\nabc"),
    ({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "t1"}, "cache_salt:t1\nuser:hi"),
    ({"prompt": "abc", "cache_salt": ""}, "abc"),
    ({"prompt": "abc", "cache_salt": 5}, "abc"),
    # and of one LoRA adapter, which the model names: the model leads it
    ({"prompt": "abc", "model": "tuned", "cache_salt": "t1"}, "model:tuned\ncache_salt:t1\nabc"),
    ({"prompt": "abc", "model": ""}, "abc"),
    # the Responses API: its instructions (the system message), then its input items
    ({"input": "hi", "instructions": "be brief"}, "system:be brief\nuser:hi"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "function_call", "call_id": "c", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "sunny"}, 7]},
     "user:weather?\nfunction_call:{}\nfunction_call_output:sunny"),
    ({"input": {"not": "items"}}, ""),
    # Anthropic's Messages API: its system prompt (a string or text blocks), then its turns' text, calls and results
    ({"system": [{"type": "text", "text": "be brief"}], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "w", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "sunny"}]}]}]},
     "system:be brief\nuser:weather?\nassistant:w\nuser:sunny"),
    ({"system": 5, "messages": [{"role": "user", "content": "hi"}]}, "user:hi"),
])
def test_prompt_text(payload: dict, text: str) -> None:
    assert prompt_text(payload) == text


@pytest.mark.parametrize("path, payload, text", [
    ("/v1/embeddings", {"input": "abc", "model": "m"}, "model:m\nabc"),
    ("/v1/embeddings", {"input": [1, 2]}, "[1, 2]"),
    ("/pooling", {"input": ["abc", "d"], "cache_salt": "t"}, 'cache_salt:t\n["abc", "d"]'),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}, "user:hi"),
    ("/score", {"text_1": "abc", "text_2": "d"}, "abc"),
    ("/v1/score", {"data_1": ["abc", "e"], "data_2": ["d", "f"]}, "abc"),
    ("/score", {"queries": [{"content": []}], "documents": "d"}, ""),
    ("/rerank", {"query": "abc", "documents": ["d"]}, "abc"),
    ("/v2/rerank", {"query": 5, "documents": ["d"]}, ""),
    ("/v1/responses", {"input": "hi"}, "user:hi"),  # prompt_text's, elsewhere
])
def test_a_pooling_request_is_keyed_on_its_first_prompt(path: str, payload: dict, text: str) -> None:
    assert request_text(path, payload) == text


def test_only_a_long_prompts_leading_characters_are_keyed() -> None:
    """A 4 MiB prompt was hashed whole (106 ms of the router's event loop, 62,500 keys in the index)."""
    huge = "a" * (MAX_KEYED_CHARS * 4)
    assert prompt_text({"prompt": huge}) == huge[:MAX_KEYED_CHARS]
    assert prompt_text({"messages": [{"role": "user", "content": huge}] * 3}) == ("user:" + huge)[:MAX_KEYED_CHARS]
    assert len(prompt_text({"prompt": list(range(MAX_KEYED_CHARS))})) == MAX_KEYED_CHARS


@pytest.mark.parametrize("body, payload", [
    (b'{"prompt": "p"}', {"prompt": "p"}), (b"{nope", {}), (b"[1, 2]", {}), (b"", {}), (b"\xff", {}),
    (b"[" * 100_000, {}),
])
def test_a_body_that_is_no_json_object_is_read_as_no_prompt(body: bytes, payload: dict) -> None:
    assert request_payload(body) == payload


def test_a_body_nested_past_the_recursion_limit_is_keyed_without_recursing() -> None:
    """Anthropic's tool results hold blocks: read one level down, so a body nested thousands deep (which JSON
    parsing takes) is keyed, not a RecursionError the router answered with a 500."""
    inner: dict = {"type": "text", "text": "x"}
    for _ in range(5000):
        inner = {"type": "tool_result", "tool_use_id": "t", "content": [inner]}
    assert prompt_text({"messages": [{"role": "user", "content": [inner]}]}) == "user:"
    result = {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "sunny"}]}
    assert prompt_text({"messages": [{"role": "user", "content": [result]}]}) == "user:sunny"
