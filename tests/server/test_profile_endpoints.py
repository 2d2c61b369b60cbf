"""vLLM's profiling endpoints over HTTP: with ``$VLLM_TORCH_PROFILER_DIR`` set, POST /start_profile then
/stop_profile writes one trace of the steps between into it; a stop without a start or a second start is a 400
saying so; without the variable each is a 404 naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from kvserve.server.app import build_app
from kvserve.server.state import ServerSettings, ServerState
from tests.server.test_dev_endpoints import MODEL, PROMPT, serving


@pytest.fixture(scope="module")
def state(tiny_checkpoints) -> Iterator[ServerState]:
    state = serving(tiny_checkpoints["llama"])
    yield state
    state.engine.shutdown()


@pytest.mark.parametrize("path", ["/start_profile", "/stop_profile"])
def test_without_the_variable_each_is_a_404_naming_it(state: ServerState, monkeypatch, path: str) -> None:
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    answer = TestClient(build_app(state)).post(path)
    assert answer.status_code == 404 and "VLLM_TORCH_PROFILER_DIR" in answer.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/start_profile", "/stop_profile"])
def test_they_ask_for_the_api_key_where_one_is_set(monkeypatch, tmp_path: Path, path: str) -> None:
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    guarded = TestClient(build_app(ServerState(ServerSettings((MODEL,), "path", api_keys=("k",)))))
    assert guarded.post(path).status_code == 401


def test_a_start_and_a_stop_write_one_trace_of_the_steps_between(state: ServerState, monkeypatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    client = TestClient(build_app(state))
    stopped = client.post("/stop_profile")
    assert stopped.status_code == 400 and "without a start_profile" in stopped.json()["error"]["message"]
    assert client.post("/start_profile").status_code == 200
    second = client.post("/start_profile")
    assert second.status_code == 400 and "running already" in second.json()["error"]["message"]
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    assert answer.status_code == 200, answer.text
    assert client.post("/stop_profile").status_code == 200
    (trace,) = tmp_path.iterdir()
    assert trace.name.endswith(".pt.trace.json.gz") and trace.stat().st_size > 0
