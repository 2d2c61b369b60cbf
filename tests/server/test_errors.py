"""Every bad input is a 400 (or 404 / 413) in OpenAI's error shape, and the server stays healthy after each."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from kvserve.server.errors import install_error_handlers
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, ServerProcess

GOOD_COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def completion(**fields) -> bytes:
    return json.dumps({**GOOD_COMPLETION, **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({**GOOD_CHAT, **fields}).encode()


BAD_COMPLETIONS = {
    "malformed json": b'{"prompt": "Hello", ',
    "not an object": b'["Hello"]',
    "missing prompt": json.dumps({"model": MODEL_NAME}).encode(),
    "mistyped max_tokens": completion(max_tokens="many"),
    "mistyped prompt": completion(prompt={"text": "Hello"}),
    "max_tokens zero": completion(max_tokens=0),
    "max_tokens negative": completion(max_tokens=-3),
    "negative temperature": completion(temperature=-0.5),
    "top_p zero": completion(top_p=0),
    "top_p above one": completion(top_p=1.5),
    "n zero": completion(n=0),
    "n above the limit": completion(n=1000),
    "empty prompt": completion(prompt=""),
    "empty prompt list": completion(prompt=[]),
    "prompt plus max_tokens over max_model_len": completion(max_tokens=MAX_MODEL_LEN),
    "token id outside the vocabulary": completion(prompt=[1, 10**9]),
    "negative token id": completion(prompt=[-1]),
    "invalid utf-8": b'{"prompt": "Hel\xff\xfelo", "max_tokens": 2}',
    "lone surrogate": b'{"prompt": "Hel\\ud800lo", "max_tokens": 2}',
    "too many stop strings": completion(stop=[f"s{i}" for i in range(100)]),
    "empty stop string": completion(stop=[""]),
    "logprobs above the limit": completion(logprobs=100),
    "logit_bias key not a token": completion(logit_bias={"abc": 1.0}),
    "logit_bias out of range": completion(logit_bias={"1": 1000.0}),
    "stop_token_ids outside the vocabulary": completion(stop_token_ids=[10**9]),
    "stream_options without stream": completion(stream_options={"include_usage": True}),
    "min_tokens above max_tokens": completion(min_tokens=5, max_tokens=2),
    "an unknown field": completion(temprature=0.5),
    "a vLLM field kvserve does not implement": completion(kv_transfer_params={}),
    "stream not a boolean": completion(stream="yes"),
    "structured_outputs regex not a string": completion(structured_outputs={"regex": 5}),
    "logit_bias key a non-ASCII digit": completion(logit_bias={"\u00b2": 1.0}),
    "repetition_penalty that fp32 cannot hold": completion(repetition_penalty=1e-300),
    "an empty cache_salt": completion(cache_salt=""),
    "priority not an integer": completion(priority="high"),
}

BAD_CHATS = {
    "empty messages": chat(messages=[]),
    "missing messages": json.dumps({"model": MODEL_NAME}).encode(),
    "unknown role": chat(messages=[{"role": "wizard", "content": "Hi"}]),
    "message without role": chat(messages=[{"content": "Hi"}]),
    "image content": chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    "a part's type an object": chat(messages=[{"role": "user", "content": [{"type": {"a": 1}}]}]),
    "tool arguments nested past the recursion limit": chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]),
    "top_logprobs without logprobs": chat(top_logprobs=2),
    "top_logprobs above the limit": chat(logprobs=True, top_logprobs=50),
    "negative frequency_penalty": chat(frequency_penalty=-5),
    "max_completion_tokens zero": chat(max_completion_tokens=0),
    "a user message without content": chat(messages=[{"role": "user"}]),
    "cache_salt not a string": chat(cache_salt=5),
}


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def assert_still_serving(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    answer = httpx.post(f"{server.url}/v1/completions", json=GOOD_COMPLETION, timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("body", BAD_COMPLETIONS.values(), ids=BAD_COMPLETIONS.keys())
def test_a_bad_completion_request_is_a_400(server: ServerProcess, body: bytes) -> None:
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, 400)
    assert_still_serving(server)


@pytest.mark.parametrize("body", BAD_CHATS.values(), ids=BAD_CHATS.keys())
def test_a_bad_chat_request_is_a_400(server: ServerProcess, body: bytes) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert_openai_error(response, 400)
    assert_still_serving(server)


def test_a_bad_streaming_request_is_a_400_before_any_event(server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}/v1/completions", content=completion(stream=True, max_tokens=0))
    assert_openai_error(response, 400)
    assert_still_serving(server)


def test_an_unknown_model_is_a_404(server: ServerProcess) -> None:
    json_header = {"content-type": "application/json"}
    response = httpx.post(f"{server.url}/v1/completions", content=completion(model="gpt-9"), headers=json_header)
    error = assert_openai_error(response, 404)
    assert error["param"] == "model" and "gpt-9" in error["message"]
    response = httpx.post(f"{server.url}/v1/chat/completions", content=chat(model="gpt-9"), headers=json_header)
    assert_openai_error(response, 404)
    assert_still_serving(server)


def test_a_body_over_the_limit_is_a_413(server: ServerProcess) -> None:
    huge = completion(prompt="a" * (5 * 2**20))
    assert_openai_error(httpx.post(f"{server.url}/v1/completions", content=huge), 413)
    assert_still_serving(server)


def test_a_client_still_sending_a_body_over_the_limit_reads_the_413(server: ServerProcess) -> None:
    """Answered from its declared length while its body still comes: the connection is half-closed and the rest
    read and dropped, so that closing it sends no reset (which overtook the answer: "connection reset", every time,
    for a client that reads after sending some of its body; httpx saw it now and then)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % (5 * 2**20))
        client.sendall(b"a" * 2**20)
        time.sleep(0.3)  # the answer and the close come meanwhile
        answer = b""
        while chunk := client.recv(65536):  # the server's half-close ends it
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and json.loads(body)["error"]["code"] == 413
    assert_still_serving(server)


def test_unknown_routes_and_methods_answer_in_the_same_shape(server: ServerProcess) -> None:
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_openai_error(httpx.get(f"{server.url}/v1/completions"), 405)
    assert_openai_error(httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]}), 400)
    # a text no context could hold is not tokenized on the engine thread (3.9 MB held every stream 3.4 s)
    error = assert_openai_error(httpx.post(f"{server.url}/tokenize", json={"prompt": "a" * 3_000_000}), 400)
    assert error["param"] == "prompt" and "more tokens than max_model_len" in error["message"]
    assert_still_serving(server)


def test_an_error_names_the_field_as_the_request_sent_it(server: ServerProcess) -> None:
    cases = [(completion(temprature=0.5), "/v1/completions", "temprature"),
             (completion(structured_outputs={"regex": 5}), "/v1/completions", "structured_outputs.regex"),
             (chat(logprobs=True, top_logprobs=50), "/v1/chat/completions", "top_logprobs"),
             (chat(functions=[{"name": "f"}]), "/v1/chat/completions", "functions"),
             (completion(suffix="x"), "/v1/completions", "suffix"),
             (completion(best_of=3), "/v1/completions", "best_of"),
             (completion(tools=[]), "/v1/completions", "tools"),
             (completion(prompt=""), "/v1/completions", "prompt"),
             # vLLM's priority needs --scheduling-policy priority (this server's policy is lpm)
             (completion(priority=1), "/v1/completions", "priority"),
             (chat(priority=-1), "/v1/chat/completions", "priority"),
             # a batch is queued at once, ahead of every later request: at most 2,048 samples
             (completion(prompt=[[5]] * 2049), "/v1/completions", "prompt"),
             (completion(prompt=["a"] * 33, n=64), "/v1/completions", "prompt")]
    for body, route, param in cases:
        error = assert_openai_error(httpx.post(f"{server.url}{route}", content=body,
                                               headers={"content-type": "application/json"}), 400)
        assert error["param"] == param and error["message"].startswith(param), error


def test_values_at_the_edges_are_served_as_their_limits(server: ServerProcess) -> None:
    """A top-k past int64 keeps every token (it once killed the engine thread), a temperature of 1e-40 is greedy
    (it once drew NaN: every token the first id), and null takes a field's default."""
    def complete(**fields) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", json={**GOOD_COMPLETION, "max_tokens": 6, **fields})

    greedy = complete(temperature=0).json()["choices"][0]["text"]
    for fields in (dict(temperature=1e-40), dict(top_p=1e-300, seed=1), dict(temperature=0, n=None, echo=None)):
        answer = complete(**fields)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == greedy, (fields, answer.text)
    huge_k = complete(top_k=2**63, seed=3)
    assert huge_k.status_code == 200 and huge_k.json()["usage"]["completion_tokens"] == 6
    assert_still_serving(server)


def test_a_405_lists_the_allowed_methods_in_one_order_whatever_the_hash_seed() -> None:
    """Starlette lists a route's methods in a set's order, which changes with PYTHONHASHSEED: the server's 405
    named "HEAD, GET" in one process and "GET, HEAD" in another (the router's is "GET, HEAD")."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from starlette.exceptions import HTTPException

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/unordered")
    async def unordered() -> None:
        raise HTTPException(405, headers={"Allow": "HEAD, GET"})

    answer = TestClient(app).get("/unordered")
    assert answer.status_code == 405 and answer.headers["allow"] == "GET, HEAD"
    assert answer.json()["error"]["message"] == "GET /unordered: this route takes GET, HEAD"


def test_a_text_too_long_for_any_tokenization_is_refused_naming_its_field(server: ServerProcess) -> None:
    """Refused before it is tokenized (its characters outnumber any tokenization's room); it was a 400 with no
    ``param`` on /v1/completions, where the same refusal on /tokenize named the prompt."""
    long_text = "hi " * 200_000
    for route, body, param in [("/v1/completions", completion(prompt=long_text), "prompt"),
                               ("/v1/chat/completions", chat(messages=[{"role": "user", "content": long_text}]),
                                "messages")]:
        response = httpx.post(f"{server.url}{route}", content=body, headers={"content-type": "application/json"})
        assert assert_openai_error(response, 400)["param"] == param
    assert_still_serving(server)
