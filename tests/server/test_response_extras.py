"""vLLM's extra request fields over HTTP: token ids (``return_token_ids``), usage in every chunk
(``stream_options.continuous_usage_stats``), chat's ``echo``, a body's ``request_id``, ``prompt_logprobs`` and
``return_tokens_as_token_ids``. Shapes over the model-free FakeEngine (fast); logprobs over a real server."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess
from tests.server.test_app_fake_engine import InProcessServer

USER = {"role": "user", "content": "x"}
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def fake() -> Iterator[InProcessServer]:
    server = InProcessServer()
    yield server
    server.stop()


def post(url: str, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30, **kwargs)


def events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=30) as answer:
        assert answer.status_code == 200, answer.read()
        return [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]


def refusal(answer: httpx.Response) -> str:
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]["param"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["ab", "cde"], "n": 2}),
    ("/v1/chat/completions", {"messages": [USER], "n": 2}),
])
def test_continuous_usage_gives_every_chunk_its_choices_usage_so_far(fake: InProcessServer, path: str,
                                                                      body: dict[str, Any]) -> None:
    chunks = events(fake.url, path, {**body, "max_tokens": 4, "return_token_ids": True,
                                     "stream_options": CONTINUOUS})
    *choice_chunks, last = chunks
    num_tokens: dict[int, int] = {}
    for chunk in choice_chunks:
        for choice in chunk["choices"]:  # a chat's role chunk holds every choice, before any token
            num_tokens[choice["index"]] = num_tokens.get(choice["index"], 0) + len(choice.get("token_ids", []))
        usage = chunk["usage"]
        assert usage["completion_tokens"] == num_tokens[chunk["choices"][0]["index"]]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(num_tokens.values()) == 4 * len(num_tokens)
    if path == "/v1/completions":  # each choice counts its own prompt
        assert {c["usage"]["prompt_tokens"] for c in choice_chunks} == {2, 3}


def test_without_continuous_usage_only_the_last_chunk_counts(fake: InProcessServer) -> None:
    chunks = events(fake.url, "/v1/completions", {"prompt": "ab", "max_tokens": 3,
                                                  "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 3


def test_continuous_usage_without_usage_is_refused_rather_than_ignored(fake: InProcessServer) -> None:
    body = {"prompt": "ab", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert refusal(post(fake.url, "/v1/completions", body)) == "stream_options.continuous_usage_stats"


def test_completions_return_the_prompts_and_each_choices_token_ids(fake: InProcessServer) -> None:
    body = {"prompt": ["ab", "xy"], "max_tokens": 3, "return_token_ids": True}
    whole = post(fake.url, "/v1/completions", body).json()
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [[97, 98], [120, 121]]
    assert [c["token_ids"] for c in whole["choices"]] == [[99, 100, 101], [122, 123, 124]]
    chunks = events(fake.url, "/v1/completions", body)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list[list[int]]] = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        streamed[choice["index"]] += choice["token_ids"]
        prompts[choice["index"]] += [choice["prompt_token_ids"]] if "prompt_token_ids" in choice else []
    assert streamed == {0: [99, 100, 101], 1: [122, 123, 124]}
    assert prompts == {0: [[97, 98]], 1: [[120, 121]]}  # in each choice's first chunk only


def test_chat_returns_the_prompts_and_each_choices_token_ids(fake: InProcessServer) -> None:
    body = {"messages": [USER], "max_tokens": 3, "return_token_ids": True}
    whole = post(fake.url, "/v1/chat/completions", body).json()
    prompt = list(b"<user>x<assistant>")
    assert whole["prompt_token_ids"] == prompt and whole["choices"][0]["token_ids"] == list(b"?@A")
    role, *rest = events(fake.url, "/v1/chat/completions", body)
    assert role["prompt_token_ids"] == prompt and role["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in c for c in rest)
    assert [t for c in rest for t in c["choices"][0]["token_ids"]] == list(b"?@A")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "ab"}), ("/v1/chat/completions", {"messages": [USER]}),
])
def test_an_answer_carries_no_extra_its_request_did_not_ask_for(fake: InProcessServer, path: str,
                                                                body: dict[str, Any]) -> None:
    extras = {"token_ids", "prompt_token_ids", "prompt_logprobs"}
    whole = post(fake.url, path, {**body, "max_tokens": 2}).json()
    assert not extras & (whole.keys() | whole["choices"][0].keys())
    for chunk in events(fake.url, path, {**body, "max_tokens": 2}):
        assert not extras & (chunk.keys() | chunk["choices"][0].keys())


PREFILL = [USER, {"role": "assistant", "content": "Hi"}]


@pytest.mark.parametrize("messages, options, echoed", [
    (PREFILL, {"add_generation_prompt": False, "continue_final_message": True}, "Hi"),
    ([USER, {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
     {"add_generation_prompt": False, "continue_final_message": True}, "a\nb"),
    ([USER], {}, ""),  # the last message is not the reply's role (the assistant's)
])
def test_chat_echo_puts_the_last_message_before_the_reply_where_it_is_the_replys_role(
        fake: InProcessServer, messages: list[dict[str, Any]], options: dict[str, Any], echoed: str) -> None:
    body = {"messages": messages, "max_tokens": 3, **options}
    plain = post(fake.url, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    whole = post(fake.url, "/v1/chat/completions", {**body, "echo": True, "n": 2}).json()
    assert [c["message"]["content"] for c in whole["choices"]] == [echoed + plain] * 2
    chunks = events(fake.url, "/v1/chat/completions", {**body, "echo": True, "n": 2})
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"]["content"] or ""
    assert texts == {0: echoed + plain, 1: echoed + plain}


def test_a_bodys_request_id_names_the_answer_unless_x_request_id_does(fake: InProcessServer) -> None:
    for path, body, prefix in (("/v1/completions", {"prompt": "ab"}, "cmpl"),
                               ("/v1/chat/completions", {"messages": [USER]}, "chatcmpl")):
        body = {**body, "max_tokens": 2, "request_id": "job-1"}
        assert post(fake.url, path, body).json()["id"] == f"{prefix}-job-1"
        assert {c["id"] for c in events(fake.url, path, body)} == {f"{prefix}-job-1"}
        assert post(fake.url, path, body, headers={"X-Request-Id": "hdr"}).json()["id"] == f"{prefix}-hdr"
    for bad in ("", "a\nb"):
        assert refusal(post(fake.url, "/v1/completions", {"prompt": "ab", "request_id": bad})) == "request_id"


def test_fields_kvserve_does_not_do_as_asked_are_refused_by_name(fake: InProcessServer) -> None:
    assert refusal(post(fake.url, "/v1/completions", {"prompt": "ab", "prompt_logprobs": 1, "stream": True})) \
        == "prompt_logprobs"
    assert refusal(post(fake.url, "/v1/chat/completions", {
        "messages": [USER], "skip_special_tokens": False, "spaces_between_special_tokens": False})) \
        == "spaces_between_special_tokens"
    # where no special token is text, false changes nothing, in vLLM too
    for spaces in (True, False):
        answer = post(fake.url, "/v1/completions", {"prompt": "ab", "max_tokens": 2,
                                                    "spaces_between_special_tokens": spaces})
        assert answer.status_code == 200, answer.text


# over a real model: logprobs

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True}


def test_return_tokens_as_token_ids_spells_every_logprob_entry_by_its_id(server: ServerProcess) -> None:
    body = {**GREEDY, "prompt": PROMPT, "max_tokens": 4, "logprobs": 2, "return_token_ids": True}
    plain = post(server.url, "/v1/completions", body).json()["choices"][0]
    by_id = post(server.url, "/v1/completions", {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert by_id["text"] == plain["text"]
    assert by_id["logprobs"]["tokens"] == [f"token_id:{t}" for t in plain["token_ids"]]
    assert all(key.startswith("token_id:") for top in by_id["logprobs"]["top_logprobs"] for key in top)
    assert by_id["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]  # still places in the text
    assert by_id["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    chat = {**GREEDY, "messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = post(server.url, "/v1/chat/completions", chat).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(top["token"].startswith("token_id:") for entry in content for top in entry["top_logprobs"])
    assert all(entry["bytes"] for entry in content)  # the token's own bytes, as without the field


def test_prompt_logprobs_score_every_prompt_token_but_the_first(server: ServerProcess) -> None:
    body = {**GREEDY, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3, "return_token_ids": True}
    choice = post(server.url, "/v1/completions", body).json()["choices"][0]
    prompt_ids, positions = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    for token_id, position in zip(prompt_ids[1:], positions[1:]):
        assert str(token_id) in position and len(position) <= 4  # the prompt's token beside the 3 most likely
        assert sorted(e["rank"] for e in position.values() if e["rank"] <= 3) == [1, 2, 3]
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in position.values())
    # the same numbers as echo's entries for the prompt
    echoed = post(server.url, "/v1/completions", {**GREEDY, "prompt": PROMPT, "max_tokens": 2, "logprobs": 0,
                                                  "echo": True}).json()["choices"][0]["logprobs"]
    expected = [position[str(t)]["logprob"] for t, position in zip(prompt_ids[1:], positions[1:])]
    assert echoed["token_logprobs"][1:len(prompt_ids)] == pytest.approx(expected)
    chat = post(server.url, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, "max_tokens": 2,
                                                     "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(position) == 1 for position in chat["prompt_logprobs"][1:])  # k = 0: the prompt's own token
