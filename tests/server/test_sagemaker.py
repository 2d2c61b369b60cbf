"""SageMaker's routes, as vLLM serves them: GET and POST /ping answer as /health does; POST /invocations serves a
chat body as /v1/chat/completions and a completion body as /v1/completions (streaming too), an embedding, score,
rerank or pooling body as its endpoint, and refuses a body that is none of them with a 400 naming what each found
wrong; /invocations asks for the API key where one is set."""

from __future__ import annotations

from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from kvserve.server.app import build_app
from kvserve.server.state import ServerSettings, ServerState
from tests.server.test_dev_endpoints import MODEL, PROMPT, serving

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}


@pytest.fixture(scope="module")
def client(tiny_checkpoints) -> Iterator[TestClient]:
    state = serving(tiny_checkpoints["llama"])
    yield TestClient(build_app(state))
    state.engine.shutdown()


def _answer(client: TestClient, path: str, body: dict) -> dict:
    answer = client.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("body, path", [
    ({"model": MODEL, "input": ["hi there", "a cat"]}, "/v1/embeddings"),
    ({"model": MODEL, "text_1": "hi there", "text_2": ["a cat", "hi"]}, "/score"),
    ({"model": MODEL, "query": "hi there", "documents": ["a cat", "hi"]}, "/rerank"),
    ({"model": MODEL, "input": "hi there", "task": "token_embed"}, "/pooling"),
])
def test_a_pooling_invocation_is_served_by_its_endpoint(client: TestClient, body: dict, path: str) -> None:
    invoked, direct = _answer(client, "/invocations", body), _answer(client, path, body)
    for answer in (invoked, direct):
        del answer["id"], answer["usage"]  # fresh ids; the second finds the first's prompts cached
        answer.pop("created", None)
    assert invoked == direct


@pytest.mark.parametrize("method", ["GET", "POST", "HEAD"])
def test_ping_answers_as_health(client: TestClient, method: str) -> None:
    assert client.request(method, "/ping").status_code == 200


def test_ping_is_a_503_until_the_model_serves() -> None:
    loading = TestClient(build_app(ServerState(ServerSettings((MODEL,), "path"))))
    answer = loading.post("/ping")
    assert answer.status_code == 503 and "not ready" in answer.json()["error"]["message"]


@pytest.mark.parametrize("body, path, kind", [(CHAT, "/v1/chat/completions", "chat.completion"),
                                              (COMPLETION, "/v1/completions", "text_completion")])
def test_an_invocation_is_served_by_the_endpoint_its_body_is_a_request_of(client: TestClient, body: dict, path: str,
                                                                          kind: str) -> None:
    invoked, direct = _answer(client, "/invocations", body), _answer(client, path, body)
    assert invoked["object"] == direct["object"] == kind
    assert invoked["choices"] == direct["choices"]
    for usage in (invoked["usage"], direct["usage"]):
        usage.pop("prompt_tokens_details", None)  # the second of them finds the first's prompt cached
    assert invoked["usage"] == direct["usage"]


def test_a_streamed_invocation_streams_as_its_endpoint(client: TestClient) -> None:
    with client.stream("POST", "/invocations", json={**CHAT, "stream": True}) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and '"chat.completion.chunk"' in lines[0]


@pytest.mark.parametrize("body, words", [
    ({"model": MODEL, "text": "hi"},
     ["chat completion (messages: Field required", "completion (prompt: Field required", "embedding (",
      "score (", "rerank (", "pooling ("]),
    ({**CHAT, "messages": []}, ["chat completion (messages: List should have at least 1 item", "completion ("]),
    ([1, 2], ["chat completion (", "completion ("]),
])
def test_a_body_that_is_no_request_it_serves_is_a_400_naming_each_refusal(client: TestClient, body, words) -> None:
    answer = client.post("/invocations", json=body)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith("the body is none of the requests /invocations serves: ")
    assert all(word in message for word in words), message


def test_a_chat_request_with_a_bad_value_gets_the_chat_endpoints_own_400(client: TestClient) -> None:
    answer = client.post("/invocations", json={**CHAT, "temperature": -1})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "temperature", answer.text


def test_a_body_that_is_no_json_is_a_400_saying_so(client: TestClient) -> None:
    answer = client.post("/invocations", content=b"{not json", headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("the body is not JSON")


def test_invocations_takes_post_only(client: TestClient) -> None:
    assert client.get("/invocations").status_code == 405


def test_invocations_asks_for_the_api_key_where_one_is_set() -> None:
    guarded = TestClient(build_app(ServerState(ServerSettings((MODEL,), "path", api_keys=("k",)))))
    assert guarded.post("/invocations", json=CHAT).status_code == 401
    assert guarded.post("/ping").status_code == 503  # open, as /health is: the model is not loaded here
