"""vLLM's development endpoints over HTTP (``$VLLM_SERVER_DEV_MODE=1``): POST /reset_prefix_cache empties the
prefix cache (its gauge true after it), answers 409 while a running request holds cached blocks, refuses a bad or
unknown query parameter by name; sleep mode's /sleep (aborting what runs), /wake_up and /is_sleeping, a request
sent meanwhile a 503 naming sleep mode; without the variable each a 404 saying how to turn it on."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from kvserve.engine_args import EngineArgs
from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app
from kvserve.server.launch import load_engine
from kvserve.server.state import ServerSettings, ServerState
from tests.server.conftest import scrape

MODEL = "tiny-llama"
PROMPT = list(range(3, 40))
OPTIONS = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256, "block_size": 4,
           "enable_prefix_caching": True}


def serving(path: Path) -> ServerState:
    """A server's state with the tiny checkpoint's engine loaded and running (shut it down after)."""
    state = ServerState(ServerSettings((MODEL,), str(path)))
    load_engine(state, EngineArgs(model=str(path), **OPTIONS).create_engine_config(), "http://127.0.0.1:0")
    assert state.load_error is None, state.load_error
    return state


@pytest.fixture(scope="module")
def state(tiny_checkpoints) -> Iterator[ServerState]:
    state = serving(tiny_checkpoints["llama"])
    yield state
    state.engine.shutdown()


@pytest.fixture
def dev_client(state: ServerState, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    return TestClient(build_app(state))


def _cached_blocks(client: TestClient) -> float:
    return scrape(client.get("/metrics").text, "kvserve:prefix_cache_blocks")


def _complete(client: TestClient) -> None:
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("method, path", [("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
                                          ("GET", "/is_sleeping")])
def test_without_dev_mode_each_route_is_a_404_saying_how_to_turn_it_on(state, monkeypatch, method, path) -> None:
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    answer = TestClient(build_app(state)).request(method, path)
    assert answer.status_code == 404
    assert "VLLM_SERVER_DEV_MODE=1" in answer.json()["error"]["message"]


def test_a_reset_empties_the_prefix_cache_and_its_gauge(dev_client: TestClient) -> None:
    _complete(dev_client)
    assert _cached_blocks(dev_client) > 0
    answer = dev_client.post("/reset_prefix_cache")
    assert answer.status_code == 200, answer.text
    assert _cached_blocks(dev_client) == 0
    assert dev_client.post("/reset_prefix_cache?reset_external=true").status_code == 200  # no tiers: nothing more


def test_a_reset_while_a_request_holds_cached_blocks_is_a_409(dev_client: TestClient, state: ServerState) -> None:
    def start_running(engine) -> None:  # on the engine thread: added and stepped, its prompt's blocks cached
        engine.add_request("held", {"prompt_token_ids": PROMPT},
                           SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        engine.step()

    asyncio.run(state.engine.call(start_running))
    try:
        answer = dev_client.post("/reset_prefix_cache")
        assert answer.status_code == 409, answer.text
        assert "running requests still hold cached blocks" in answer.json()["error"]["message"]
    finally:
        asyncio.run(state.engine.call(lambda engine: engine.abort_request(["held"])))
    assert dev_client.post("/reset_prefix_cache").status_code == 200


@pytest.mark.parametrize("query, param", [("reset_running_requests=true", "reset_running_requests"),
                                          ("reset_external=maybe", "reset_external"),
                                          ("reset_everything=true", "reset_everything")])
def test_a_bad_or_unknown_query_parameter_is_a_400_naming_it(dev_client: TestClient, query: str, param: str) -> None:
    answer = dev_client.post(f"/reset_prefix_cache?{query}")
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize("method, path", [("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
                                          ("GET", "/is_sleeping")])
def test_the_dev_endpoints_ask_for_the_api_key_where_one_is_set(monkeypatch, method: str, path: str) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    guarded = TestClient(build_app(ServerState(ServerSettings((MODEL,), "path", api_keys=("k",)))))
    assert guarded.request(method, path).status_code == 401


def test_the_reset_takes_post_only(dev_client: TestClient) -> None:
    assert dev_client.get("/reset_prefix_cache").status_code == 405


def _is_sleeping(client: TestClient) -> bool:
    answer = client.get("/is_sleeping")
    assert answer.status_code == 200, answer.text
    return answer.json()["is_sleeping"]


def _running_request(client: TestClient, state: ServerState) -> tuple[threading.Thread, list]:
    """A completion of 200 tokens posted on a thread of its own, running once this returns; its answer comes into
    the list."""
    answers: list = []
    running = threading.Thread(target=lambda: answers.append(client.post("/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True})))
    running.start()
    deadline = time.monotonic() + 30
    while not state.engine.stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.005)
    return running, answers


def test_a_sleep_refused_aborts_nothing(dev_client: TestClient, state: ServerState) -> None:
    running, answers = _running_request(dev_client, state)
    assert dev_client.post("/sleep?level=3").status_code == 400
    running.join(60)
    assert answers[0].json()["usage"]["completion_tokens"] == 200


def test_sleep_aborts_what_runs_refuses_requests_with_a_503_and_wakes_up(dev_client: TestClient,
                                                                         state: ServerState) -> None:
    running, answers = _running_request(dev_client, state)
    assert dev_client.post("/sleep?level=1").status_code == 200
    running.join(30)
    assert answers and answers[0].status_code == 200, answers  # answered, not hung: cut short
    assert answers[0].json()["usage"]["completion_tokens"] < 200
    assert _is_sleeping(dev_client) and _cached_blocks(dev_client) == 0
    refused = dev_client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert refused.status_code == 503 and "sleep mode" in refused.json()["error"]["message"]
    streamed = dev_client.post("/v1/chat/completions", json={"model": MODEL, "stream": True, "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]})
    assert streamed.status_code == 503
    again = dev_client.post("/sleep")
    assert again.status_code == 400 and "asleep already" in again.json()["error"]["message"]
    assert dev_client.post("/wake_up?tags=weights&tags=kv_cache").status_code == 200
    assert not _is_sleeping(dev_client)
    _complete(dev_client)


def test_sleep_level_2_wakes_weights_then_kv_cache(dev_client: TestClient) -> None:
    assert dev_client.post("/sleep?level=2").status_code == 200
    assert dev_client.post("/wake_up?tags=weights").status_code == 200
    assert _is_sleeping(dev_client)
    assert dev_client.post("/wake_up").status_code == 200
    assert not _is_sleeping(dev_client)
    _complete(dev_client)


@pytest.mark.parametrize("path, param", [("/sleep?level=3", "level"), ("/sleep?level=one", "level"),
                                         ("/sleep?mode=wait", "mode"), ("/sleep?levels=1", "levels"),
                                         ("/wake_up?tags=optimizer", "tags")])
def test_a_bad_sleep_or_wake_up_is_a_400_naming_the_parameter(dev_client: TestClient, path: str, param: str) -> None:
    answer = dev_client.post(path)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert not _is_sleeping(dev_client)
