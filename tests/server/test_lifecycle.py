"""Startup, the API key, the waiting-queue limit, and SIGTERM draining, each on its own server process."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvserve.cli import main
from kvserve.engine import llm_engine
from kvserve.model.base import CheckpointError
from kvserve.server.launch import load_engine
from kvserve.server.state import ServerSettings, ServerState
from tests.server.conftest import MODEL_NAME, NUM_KV_BLOCKS, ServerProcess


def stream_in_background(client: openai.OpenAI, max_tokens: int, results: list) -> threading.Thread:
    """Stream one completion in a thread; append (completion tokens, last finish_reason) to results."""

    def run() -> None:
        *text_chunks, usage_chunk = list(client.completions.create(
            model=MODEL_NAME, prompt="Tell me", max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        results.append((usage_chunk.usage.completion_tokens, text_chunks[-1].choices[0].finish_reason))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_startup_lines_say_what_is_served_where_and_how_many_blocks(server: ServerProcess) -> None:
    """Logged, with the time and the process (a deployment's replicas share a stream), at --log-level."""
    lines = server.log().splitlines()
    served = next(line for line in lines if "kvserve.server.launch[" in line and ": serving " in line)
    assert repr(MODEL_NAME) in served and f"{server.url}/v1" in served and re.match(r"\d{4}-\d\d-\d\d ", served)
    engine = next(line for line in lines if "kvserve.engine.llm_engine[" in line and " KV blocks of " in line)
    assert f"{NUM_KV_BLOCKS} KV blocks" in engine
    assert any("attention " in line and "prefix caching on" in line for line in lines)


def test_a_bad_flag_is_a_clear_startup_error(start_server) -> None:
    server = start_server("--kv-cache-dtype", "fp16", wait=False)
    assert server.process.wait(60) == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp16'" in server.log()  # argparse's: before any import


@pytest.fixture(scope="module")
def guarded(start_server) -> ServerProcess:
    """One sequence at a time, no waiting beyond one request, an API key, and no access log."""
    return start_server("--api-key", "sesame", "rotated", "--max-num-seqs", "1", "--max-waiting", "0",
                        "--disable-uvicorn-access-log")


def test_the_access_log_is_on_by_default_and_off_alone(server: ServerProcess, guarded: ServerProcess) -> None:
    """A router polls each replica's /health and /metrics every second: those probes, answered, leave no line
    (--log-level warning hid kvserve's own INFO lines with them)."""
    for each in (server, guarded):
        assert httpx.get(f"{each.url}/health").status_code == 200
        httpx.get(f"{each.url}/v1/models")
    assert '"GET /v1/models HTTP/1.1" 200' in server.log() and '"GET /health HTTP/1.1" 200' not in server.log()
    assert '"GET /v1/models' not in guarded.log() and ": serving " in guarded.log()


def test_a_request_head_past_h11s_bound_is_refused_and_the_server_serves_on(server: ServerProcess) -> None:
    """httptools, which uvicorn takes where it is installed, read a 200 MiB head into memory before any check (the
    API key's too): the server speaks h11, which refuses a head past its bound."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2**20 + b"\r\n\r\n")
        answer = connection.recv(1024)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_the_api_key_is_required_when_set(guarded: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError):
        guarded.openai(api_key="wrong").completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1)
    missing = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # health and metrics stay open
    for key in ("sesame", "rotated"):  # either key, as vLLM's --api-key K1 K2
        answer = guarded.openai(api_key=key).completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1)
        assert answer.usage.completion_tokens == 1


def test_a_full_waiting_queue_is_a_503_with_retry_after(guarded: ServerProcess) -> None:
    results: list = []
    client = guarded.openai(api_key="sesame")
    running = stream_in_background(client, 200, results)
    wait_for(lambda: guarded.metric("kvserve:num_requests_running") == 1)
    waiting = stream_in_background(client, 2, results)
    wait_for(lambda: guarded.metric("kvserve:num_requests_waiting") == 1)
    refused = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                         headers={"Authorization": "Bearer sesame"})
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["message"]
    running.join(60)
    waiting.join(60)
    assert sorted(results) == [(2, "length"), (200, "length")]


def test_sigterm_lets_streams_in_flight_finish_then_exits_0(start_server) -> None:
    server = start_server("--shutdown-timeout", "30")
    results: list = []
    threads = [stream_in_background(server.openai(), 200, results) for _ in range(4)]
    wait_for(lambda: server.metric("kvserve:num_requests_running") == 4)
    server.terminate()
    wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503)
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 503
    assert server.process.wait(30) == 0
    for thread in threads:
        thread.join(10)
    assert results == [(200, "length")] * 4


def _three_long_streams(start_server, grace: str) -> tuple[ServerProcess, list[threading.Thread], list]:
    """A server with the given --shutdown-timeout and three streams of 500 tokens running on it. The streams must
    outlast a short grace: replayed step graphs decode 250 tiny-model tokens in about 0.2 s, so these run the
    checkpoint's whole context step by step."""
    server = start_server("--shutdown-timeout", grace, "--max-model-len", "512", "--enforce-eager")
    results: list = []
    threads = [stream_in_background(server.openai(), 500, results) for _ in range(3)]
    wait_for(lambda: server.metric("kvserve:num_requests_running") == 3)
    return server, threads, results


def _all_aborted(threads: list[threading.Thread], results: list) -> bool:
    for thread in threads:
        thread.join(10)
    return [finish for _, finish in results] == ["abort"] * 3


def test_sigterm_aborts_what_outlasts_the_grace_period(start_server) -> None:
    server, threads, results = _three_long_streams(start_server, "0.2")
    started = time.monotonic()
    server.terminate()
    assert server.process.wait(15) == 0
    assert time.monotonic() - started < 8
    assert _all_aborted(threads, results)


def test_a_second_sigterm_aborts_the_streams_at_once_and_each_ends_cleanly(start_server) -> None:
    """The first signal drains (a 60 s grace here); a second ends the grace: each stream still running ends with
    finish_reason abort (and its usage, then [DONE]), not cut off mid-body, and the server exits 0 promptly."""
    server, threads, results = _three_long_streams(start_server, "60")
    server.terminate()
    wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503)
    started = time.monotonic()
    server.terminate()
    assert server.process.wait(15) == 0
    assert time.monotonic() - started < 5
    assert _all_aborted(threads, results)


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port must be in 0..65535, got 70000"),
    (["--port", "-1"], "--port must be in 0..65535, got -1"),
    (["--api-key", ""], "--api-key must not be empty"),
    (["--api-key", "k", " "], "--api-key must not be empty"),
])
def test_a_bad_port_or_an_empty_api_key_is_refused_at_start(tiny_checkpoint: Path, flags: list[str], message: str,
                                                            capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", str(tiny_checkpoint), "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvserve: error: {message}") and len(err.splitlines()) == 1


@pytest.mark.parametrize("error, traced", [(CheckpointError("model.safetensors is truncated"), False),
                                           (ValueError("--max-model-len 100000 is over the model's 256"), False),
                                           (RuntimeError("a bug"), True)])
def test_a_model_that_cannot_load_logs_a_traceback_only_for_a_bug(
    error: Exception, traced: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """serve() prints the load error in one line; a user's mistake (a bad model or flag) gets no traceback."""
    def fail(config: object) -> None:
        raise error

    monkeypatch.setattr(llm_engine, "LLMEngine", fail)
    state = ServerState(ServerSettings((MODEL_NAME,), MODEL_NAME))
    with caplog.at_level(logging.ERROR, logger="kvserve.server"):
        load_engine(state, None, "http://127.0.0.1:1")
    assert state.load_error is error
    assert any(record.exc_info for record in caplog.records) == traced
