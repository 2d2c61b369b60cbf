"""The HTTP layer in-process over the model-free FakeEngine: fast checks of shapes, errors, guards, aborts.

The black-box tests against a real ``kvserve serve`` process are the other files here; these pin the server's
own logic (deltas, usage, limits, disconnects) without a model.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import re
import threading
import time
from typing import Iterator

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

import kvserve
from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.app import build_app
from kvserve.server.launch import DrainingServer
from kvserve.server.metrics import ServerMetrics
from kvserve.server.sockets import UVICORN_PROTOCOLS
from kvserve.server.state import ServerSettings, ServerState
from tests.engine.fake_engine import FakeEngine
from tests.server.conftest import free_port, scrape

MODEL = "fake"


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds (never hang the run)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


class InProcessServer:
    def __init__(self, names: tuple[str, ...] = (MODEL,), step_seconds: float = 0.002, fake: FakeEngine | None = None,
                 **settings) -> None:
        self.fake = fake or FakeEngine(max_num_seqs=2, max_model_len=256, step_seconds=step_seconds)
        self.state = ServerState(ServerSettings(names, "fake-root", **settings), max_model_len=256)
        self.state.metrics = ServerMetrics(MODEL, self.fake.stats(), 256)
        self.state.engine = AsyncEngine(self.fake, observer=self.state.metrics)
        self.state.engine.start()
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.state), port=port, log_level="warning",
                                                    **UVICORN_PROTOCOLS))  # as `kvserve serve` runs it
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), "uvicorn to start")
        assert self.server.started, "uvicorn's thread ended before the server started (could it bind the port?)"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.state.engine.shutdown()

    def metric(self, name: str, **labels: str) -> float:
        return scrape(httpx.get(f"{self.url}/metrics").text, name, **labels)

    def wait_idle(self) -> None:
        wait_until(lambda: not self.fake.requests and not self.state.engine.num_unfinished(),
                   "every request to finish", timeout=5)


@pytest.fixture(scope="module")
def srv() -> Iterator[InProcessServer]:
    server = InProcessServer(max_body_bytes=10_000)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def test_completion_stream_equals_non_stream_and_usage_adds_up(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=5, n=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.usage.prompt_tokens == 4 and whole.usage.completion_tokens == 20
    chunks = list(client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=5, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {i: "" for i in range(4)}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
    assert [texts[c.index] for c in whole.choices] == [c.text for c in whole.choices] == ["cdefg"] * 2 + ["efghi"] * 2
    assert chunks[-1].usage == whole.usage and chunks[-1].choices == []


def test_echo_and_chat_shapes(client: openai.OpenAI) -> None:
    echoed = client.completions.create(model=MODEL, prompt="ab", max_tokens=2, echo=True)
    assert echoed.choices[0].text == "abcd"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=3, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert "".join(c.choices[0].delta.content for c in chunks) == whole.choices[0].message.content


def test_a_requests_priority_reaches_the_engine_from_both_endpoints(srv: InProcessServer,
                                                                   client: openai.OpenAI) -> None:
    before = set(srv.fake.priorities)
    client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=1, extra_body={"priority": -3})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                   extra_body={"priority": 7})
    client.completions.create(model=MODEL, prompt="ab", max_tokens=1)
    added = [srv.fake.priorities[rid] for rid in srv.fake.priorities if rid not in before]
    assert added == [-3, -3, 7, 0]


def test_a_chat_answer_has_every_field_openais_has(srv: InProcessServer) -> None:
    """Raw JSON, as a client without the SDK (which fills missing fields with None) reads it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    whole = httpx.post(f"{srv.url}/v1/chat/completions", json=body).json()
    assert whole["choices"][0]["message"]["refusal"] is None
    assert whole["system_fingerprint"] is None and whole["service_tier"] == "default"
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={**body, "stream": True}) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    assert all(e["service_tier"] == "default" and "system_fingerprint" in e for e in events)


def test_a_clients_x_request_id_names_the_answer_and_comes_back_whatever_the_answer(srv: InProcessServer) -> None:
    """As vLLM: the answer's id is made of it, and a response carries it back, an error's too. The same id sent
    twice at once is two requests, not a 400 for an id in use."""
    headers = {"X-Request-Id": "trace-7"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40}

    async def twice_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(client.post(f"{srv.url}/v1/chat/completions", json=chat, headers=headers)
                                          for _ in range(2)))

    for answer in asyncio.run(twice_at_once()):
        assert answer.status_code == 200, answer.text
        assert answer.json()["id"] == "chatcmpl-trace-7" and answer.headers["x-request-id"] == "trace-7"
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True},
                      headers=headers) as answer:
        assert answer.headers["x-request-id"] == "trace-7"
        assert all(json.loads(line[6:])["id"] == "cmpl-trace-7" for line in answer.iter_lines()
                   if line.startswith("data: {"))
    refused = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "top_p": 2}, headers=headers)
    too_large = httpx.post(f"{srv.url}/v1/completions", content=b"x" * 20_000, headers=headers)
    assert (refused.status_code, too_large.status_code) == (400, 413)
    assert refused.headers["x-request-id"] == too_large.headers["x-request-id"] == "trace-7"
    unnamed = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert "x-request-id" not in unnamed.headers and len(unnamed.json()["id"]) == len("cmpl-") + 32
    # any value a header holds: '#' names samples inside the engine, whose ids never come from the client
    odd = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 1, "n": 2},
                     headers={"X-Request-Id": "abc#1"})
    assert odd.status_code == 200 and odd.json()["id"] == "cmpl-abc#1" and odd.headers["x-request-id"] == "abc#1"


@pytest.mark.parametrize("body, status", [
    (b"{", 400), (b'{"prompt": 5}', 400), (b'{"prompt": "a", "max_tokens": 0}', 400),
    (b'{"prompt": "a", "top_p": 2}', 400), (b'{"prompt": "a\xff"}', 400), (b'{"prompt": "a", "model": "x"}', 404),
    (b'{"prompt": "' + b"a" * 20_000 + b'"}', 413), (b'{"prompt": "a", "max_tokens": 1000}', 400),
])
def test_bad_requests_get_openai_shaped_errors(srv: InProcessServer, body: bytes, status: int) -> None:
    response = httpx.post(f"{srv.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_disconnected_clients_abort_their_requests(srv: InProcessServer) -> None:
    aborted_before = srv.metric("kvserve:request_success_total", finished_reason="abort")

    async def leave_mid_stream(client: httpx.AsyncClient) -> None:
        body = {"prompt": "a", "max_tokens": 200, "stream": True}
        async with client.stream("POST", f"{srv.url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    return

    async def time_out(client: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.TimeoutException):
            await client.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 200}, timeout=0.2)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(leave_mid_stream(client) for _ in range(6)), *(time_out(client) for _ in range(2)))

    asyncio.run(run())
    srv.wait_idle()
    assert srv.metric("kvserve:request_success_total", finished_reason="abort") - aborted_before == 8
    assert srv.metric("kvserve:kv_cache_usage_perc") == 0


def test_metrics_count_one_requests_tokens(srv: InProcessServer, client: openai.OpenAI) -> None:
    before = srv.metric("kvserve:generation_tokens_total"), srv.metric("kvserve:prompt_tokens_total")
    client.completions.create(model=MODEL, prompt="abc", max_tokens=7)
    after = srv.metric("kvserve:generation_tokens_total"), srv.metric("kvserve:prompt_tokens_total")
    assert (after[0] - before[0], after[1] - before[1]) == (7, 3)


def test_api_key_and_waiting_limit() -> None:
    server = InProcessServer(api_keys=("k",), max_waiting=0)
    try:
        url = f"{server.url}/v1/completions"
        assert httpx.post(url, json={"prompt": "a"}).status_code == 401
        assert httpx.post(url, json={"prompt": "a"}, headers={"Authorization": "Bearer no"}).status_code == 401
        assert httpx.post(url, json={"prompt": "a"}, headers={"Authorization": "Bearer kk"}).status_code == 401
        assert httpx.post(url, json={"prompt": "a"}, headers={"Authorization": "Basic k"}).status_code == 401
        for scheme in ("bearer", "BEARER"):  # a scheme is read in any case (RFC 9110), as vLLM reads it
            assert httpx.post(url, json={"prompt": "a", "max_tokens": 1},
                              headers={"Authorization": f"{scheme} k"}).status_code == 200
        assert httpx.get(f"{server.url}/openapi.json").status_code == 404  # every field, open to anyone
        assert httpx.get(f"{server.url}/health").status_code == 200
        server.fake.max_num_seqs = 0  # nothing runs: every request stays waiting
        keyed = {"Authorization": "Bearer k"}
        waiting = threading.Thread(target=lambda: httpx.post(url, json={"prompt": "a"}, headers=keyed, timeout=30))
        waiting.start()
        wait_until(lambda: server.state.engine.num_waiting() > 0, "the request to wait in the engine")
        refused = httpx.post(url, json={"prompt": "a"}, headers=keyed)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        server.fake.max_num_seqs = 2
        waiting.join(10)
        server.state.draining = True
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert httpx.post(url, json={"prompt": "a"}, headers=keyed).status_code == 503
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_burst_is_held_to_the_waiting_limit(path: str) -> None:
    """Requests were counted as waiting only once their add reached the engine thread (after a chat's render,
    which waits for the step under way): a burst of 24 chat requests let 20 in past --max-waiting 2; and between
    the add's answer and the stats' next refresh, no longer pending nor yet in the stats, one more."""
    server = InProcessServer(max_waiting=2, step_seconds=0.05)
    stats = server.fake.stats

    def slow_stats() -> dict:  # a large engine's: an add's caller resumed before the stats counted the request
        time.sleep(0.03)
        return stats()

    server.fake.stats = slow_stats
    try:
        server.fake.max_num_seqs = 0  # nothing runs: every request admitted stays waiting
        body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}

        async def burst() -> list[int]:
            async with httpx.AsyncClient(timeout=30) as http:
                async def one() -> int:
                    try:
                        return (await http.post(f"{server.url}{path}", json={**body, "max_tokens": 2})).status_code
                    except httpx.ReadTimeout:
                        return 0
                tasks = [asyncio.create_task(one()) for _ in range(24)]
                for _ in range(200):  # until every request but those let in is answered
                    await asyncio.sleep(0.05)
                    if sum(task.done() for task in tasks) >= 21:
                        break
                await asyncio.sleep(0.5)  # time for any further answer
                refused = sum(task.done() and task.result() == 503 for task in tasks)
                server.fake.max_num_seqs = 64
                return [refused, *(await asyncio.gather(*tasks))]

        refused, *codes = asyncio.run(burst())
        assert refused == codes.count(503) == 21 and codes.count(200) == 3, codes
    finally:
        server.stop()


def test_a_batch_refused_whole_is_not_counted_and_holds_nothing(srv: InProcessServer) -> None:
    aborted_before = srv.metric("kvserve:request_success_total", finished_reason="abort")
    latencies_before = srv.metric("kvserve:e2e_request_latency_seconds_count")
    response = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ["ab", "a" * 300], "max_tokens": 5})
    assert response.status_code == 400, response.text
    srv.wait_idle()
    assert srv.metric("kvserve:request_success_total", finished_reason="abort") == aborted_before
    assert srv.metric("kvserve:e2e_request_latency_seconds_count") == latencies_before


def test_a_served_model_is_retrieved_by_name(srv: InProcessServer, client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    missing = httpx.get(f"{srv.url}/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_version_answers_the_packages_version_as_vllm_does(srv: InProcessServer) -> None:
    assert httpx.get(f"{srv.url}/version").json() == {"version": kvserve.__version__}
    assert kvserve.__version__ == importlib.metadata.version("kvserve")


def test_an_engine_that_fails_midway_ends_its_streams_with_an_error_and_stops_serving(caplog) -> None:
    server = InProcessServer()
    supervisor = DrainingServer(server.state, uvicorn.Config(build_app(server.state)))
    try:
        assert asyncio.run(supervisor.on_tick(1)) is False
        body = {"prompt": "a", "max_tokens": 200, "stream": True}
        whole: list[httpx.Response] = []
        in_flight = threading.Thread(target=lambda: whole.append(httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "b", "max_tokens": 200}, timeout=30)))
        with (caplog.at_level("WARNING"),
              httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30,
                           headers={"X-Request-Id": "trace-9"}) as response):
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            in_flight.start()
            wait_until(lambda: server.state.engine.num_unfinished() >= 2, "both requests to be in flight")
            server.fake.step_error = RuntimeError("device lost")
            rest = [line for line in lines if line]
        in_flight.join(10)
        # the cause logged once, naming the (engine's) requests it failed; each stream's end one line naming it
        (traceback,) = [record.getMessage() for record in caplog.records if record.exc_info]
        assert re.match(r"the engine loop failed; failing its requests: [12] \(cmpl-", traceback), traceback
        assert "the stream of request trace-9 ended: the engine failed (device lost)" in caplog.text
        assert whole[0].status_code == 503 and "the engine failed: device lost" in whole[0].json()["error"]["message"]
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert rest[-1] == "data: [DONE]" and error["code"] == 500 and "device lost" in error["message"]
        assert server.state.failure is not None
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "the engine failed (RuntimeError: device lost)" in health.text
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a"})
        assert refused.status_code == 503 and "the server is stopping" in refused.json()["error"]["message"]
        assert asyncio.run(supervisor.on_tick(1)) is True  # kvserve serve exits 1, for a supervisor to restart it
    finally:
        server.stop()


def test_time_per_output_token_is_per_sample_with_n_samples(srv: InProcessServer) -> None:
    """n samples decode side by side: a token's time is the decode time over one sample's tokens, not all n's."""
    names = ("time_per_output_token_seconds", "e2e_request_latency_seconds", "time_to_first_token_seconds")
    before = [srv.metric(f"kvserve:{name}_sum") for name in names]
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 40, "n": 4}).status_code == 200
    srv.wait_idle()
    tpot, e2e, ttft = (srv.metric(f"kvserve:{name}_sum") - b for name, b in zip(names, before))
    assert tpot * 39 == pytest.approx(e2e - ttft, rel=0.25)


def test_while_the_model_loads_its_context_length_is_not_known_yet() -> None:
    """/v1/models answers as soon as the server listens: its max_model_len is null until the model is loaded,
    never a 0 that a client would size its prompts by."""
    state = ServerState(ServerSettings((MODEL,), "fake-root"))
    with TestClient(build_app(state)) as loading:
        assert loading.get("/health").status_code == 503
        assert loading.get("/v1/models").json()["data"][0]["max_model_len"] is None


def test_a_whole_answer_is_built_off_the_event_loop(srv: InProcessServer, client: openai.OpenAI, monkeypatch) -> None:
    """Building a large answer took the event loop 11 s (every stream and /health waited): it runs on a thread."""
    from kvserve.server.completions import CompletionServer

    threads: list[str] = []
    build = CompletionServer._response

    def recording(self, outputs):
        threads.append(threading.current_thread().name)
        return build(self, outputs)

    monkeypatch.setattr(CompletionServer, "_response", recording)
    assert client.completions.create(model=MODEL, prompt="ab", max_tokens=2).choices[0].text == "cd"
    assert len(threads) == 1 and threads[0] != srv.thread.name


def test_an_answer_names_the_model_the_request_named_and_its_chunks_one_creation_time() -> None:
    """Each chunk took the time it was made, and every answer the first served name, not the alias asked for
    (OpenAI's chunks of one completion share ``created``; vLLM's answers echo the requested name)."""
    server = InProcessServer(names=(MODEL, "alias"), step_seconds=0.3)  # a stream of 5 tokens spans 1.5 s
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(model="alias", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=5, stream=True))
        assert {c.created for c in chunks} == {chunks[0].created} and {c.model for c in chunks} == {"alias"}
        assert client.completions.create(model="alias", prompt="ab", max_tokens=1).model == "alias"
        assert client.completions.create(model=MODEL, prompt="ab", max_tokens=1).model == MODEL
    finally:
        server.stop()


def test_a_body_that_does_not_come_whole_in_time_is_a_408_that_closes_the_connection(srv: InProcessServer,
                                                                                    monkeypatch) -> None:
    """A body sent a byte every few seconds held its connection (and a file descriptor) forever; after the 408,
    uvicorn read and dropped the rest for as long as it came, so the connection stayed: it closes now."""
    from kvserve.server import request_body

    monkeypatch.setattr(request_body, "BODY_SECONDS", 0.3)
    with _raw_connection(srv) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")
        answer = _until_closed(conn, trickle=b"1\r\n \r\n")
    assert answer.startswith(b"HTTP/1.1 408") and b"did not come whole within 0.3 s" in answer
    assert b"\r\nconnection: close\r\n" in answer.lower()


@pytest.mark.parametrize("head, status, words", [
    (b"Content-Length: 99999999\r\n", 413, b"over the limit of 10000 bytes"),  # the rest is never read
    (b"Content-Length: 9\r\nTransfer-Encoding: chunked\r\n", 400, b"both Content-Length and Transfer-Encoding"),
    (b"Content-Length: 9\r\nContent-Encoding: gzip\r\n", 415, b"Content-Encoding gzip is not supported"),
    (b"Content-Length: 9\r\nContent-Encoding: identity\r\nContent-Encoding: gzip\r\n", 415,
     b"Content-Encoding gzip is not supported"),  # a repeated header is one list (RFC 9110 section 5.3)
])
def test_an_answer_given_before_the_body_is_read_closes_the_connection(srv: InProcessServer, head: bytes,
                                                                       status: int, words: bytes) -> None:
    """A request pipelined behind a 413's unread body was read as that body and never answered; a request with two
    framings would be split differently by a proxy in front; a compressed body was "not valid UTF-8"."""
    with _raw_connection(srv) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head
                     + b"\r\n2\r\n{}\r\n0\r\n\r\n")  # a chunked body, 9 bytes
        answer = _until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 %d" % status) and words in answer
    assert b"\r\nconnection: close\r\n" in answer.lower() and b'"type":"invalid_request_error"' in answer


@pytest.mark.parametrize("request_head", [
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",  # no Host
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",
])
def test_a_request_h11_cannot_parse_is_a_400_in_openais_shape(srv: InProcessServer, request_head: bytes) -> None:
    """uvicorn answered these with the plain text "Invalid HTTP request received."."""
    with _raw_connection(srv) as conn:
        conn.sendall(request_head)
        answer = _until_closed(conn)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["message"].startswith("the request is not valid HTTP/1.1")


def _raw_connection(srv: InProcessServer):
    import socket

    host, port = srv.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _until_closed(conn, trickle: bytes = b"") -> bytes:
    """What the server sends until it closes the connection (``trickle`` sent meanwhile, every 0.1 s, as a slow
    client's body goes on: the server's socket, closed with the trickle unread, may then reset the connection
    rather than end it, after the answer); a timeout if it keeps it open."""
    import socket

    conn.settimeout(0.1)
    answer, deadline = b"", time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            part = conn.recv(65536)
        except socket.timeout:
            try:
                conn.sendall(trickle)
            except (BrokenPipeError, ConnectionResetError):  # closed: read what it sent before
                trickle = b""
            continue
        except ConnectionResetError:
            return answer
        if not part:
            return answer
        answer += part
    raise AssertionError(f"the connection stayed open after {answer[:200]!r}")


def test_a_value_echoed_in_an_error_is_cut_short(srv: InProcessServer) -> None:
    """A 1 MB model name came back whole in the 404, an unknown 100 KB field's name twice in the 400."""
    unknown = httpx.post(f"{srv.url}/v1/completions", json={"model": "m" * 5000, "prompt": "a"})  # 10 KB bodies
    assert unknown.status_code == 404 and len(unknown.content) < 1000
    field = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "x" * 5000: 1})
    assert field.status_code == 400 and len(field.content) < 1000 and field.json()["error"]["param"].endswith("...")


def test_the_api_key_comes_from_the_flag_else_the_environment(monkeypatch) -> None:
    """On the command line a key is in `ps` for every local user (and in each replica's arguments); a
    deployment moved from vLLM with its $VLLM_API_KEY does not start open."""
    from kvserve.server.environment import api_keys

    monkeypatch.setenv("VLLM_API_KEY", "vllms")
    assert api_keys(None) == ("vllms",)
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert api_keys(None) == ("from-env",) and api_keys(["flag"]) == ("flag",)
    monkeypatch.setenv("KVSERVE_API_KEY", "old\nnew\u2028\n")  # a line each, as a router hands several over
    assert api_keys(None) == ("old", "new\u2028")  # split at line feeds alone, empty lines dropped
    monkeypatch.setenv("VLLM_API_KEY", "a\u0085b")
    monkeypatch.delenv("KVSERVE_API_KEY")
    assert api_keys(None) == ("a\u0085b",)  # vLLM's one key, as it stands
    monkeypatch.setenv("KVSERVE_API_KEY", "")  # set empty: no key, whatever vLLM's says
    assert api_keys(None) == ()
    with pytest.raises(TypeError, match="a sequence of strings, got one string"):  # each character a key
        ServerSettings((MODEL,), "root", api_keys="secret")


def test_tokenize_and_detokenize_answer_and_name_the_field_as_sent(srv: InProcessServer, monkeypatch) -> None:
    from kvserve.engine.input_processor import InputProcessor

    monkeypatch.setattr(srv.fake, "input_processor", InputProcessor(srv.fake.tokenizer, 256, 256))
    tokens = httpx.post(f"{srv.url}/tokenize", json={"prompt": "ab"}).json()
    assert tokens == {"count": 2, "max_model_len": 256, "tokens": [97, 98]}
    assert httpx.post(f"{srv.url}/detokenize", json={"tokens": [97, 98]}).json() == {"prompt": "ab"}
    refused = httpx.post(f"{srv.url}/detokenize", json={"tokens": [97, 300]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    assert refused.json()["error"]["message"].startswith("tokens: 300 is not a token id of this model")
    chat = httpx.post(f"{srv.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"  # the byte tokenizer has no template


def test_an_unexpected_error_is_a_500_that_names_the_request_and_is_logged_once(srv: InProcessServer, monkeypatch,
                                                                                caplog) -> None:
    """Starlette's last handler sat outside the guard: its 500 dropped the X-Request-Id, and uvicorn logged the
    traceback a second time."""
    async def broken(*args, **kwargs):
        raise RuntimeError("boom")  # stands for any bug on a handler's path

    monkeypatch.setattr(srv.state.engine, "tokenize", broken)
    with caplog.at_level("ERROR"):
        answer = httpx.post(f"{srv.url}/tokenize", json={"prompt": "a"}, headers={"X-Request-Id": "trace-42"})
    assert answer.status_code == 500 and answer.headers["x-request-id"] == "trace-42"
    assert answer.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error",
                                      "param": None, "code": 500}
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert len(tracebacks) == 1 and "(X-Request-Id trace-42)" in tracebacks[0].getMessage(), caplog.text
    assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("content, content_type, message", [
    (b'{"prompt": "a"}', "application/x-www-form-urlencoded",
     "the body must be JSON sent with 'Content-Type: application/json'; the request sent "
     "'application/x-www-form-urlencoded'"),
    (b'{"prompt": "a"}', "text/plain", "the body must be JSON sent with 'Content-Type: application/json'"),
    (b"", "application/json", "the request body is empty: send a JSON object"),
    (b"null", "application/json", "the body must be a JSON object, not null"),
    (b'["a"]', "application/json", "the body must be a JSON object, not an array"),
    (b'"a"', "application/json", "the body must be a JSON object, not a string"),
    (b"5", "application/merge-patch+json", "the body must be a JSON object, not a number"),
])
def test_a_body_that_is_no_json_object_says_why(srv: InProcessServer, content: bytes, content_type: str | None,
                                                message: str) -> None:
    """``curl -d`` without the JSON header sends a form: it was answered as a body that is not an object."""
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        error = httpx.post(f"{srv.url}{path}", content=content, headers=headers).json()["error"]
        assert error["code"] == 400 and error["message"].startswith(message) and error["param"] is None, error


def test_routing_errors_name_the_method_and_path(srv: InProcessServer) -> None:
    missing = httpx.post(f"{srv.url}/v1/audio/speech", json={"input": "a"}).json()["error"]
    assert missing["code"] == 404 and missing["message"].startswith("kvserve serves no POST /v1/audio/speech (it "
                                                                   "serves /v1/completions, /v1/chat/completions")
    wrong = httpx.get(f"{srv.url}/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["message"] == "GET /v1/completions: this route takes POST"
    wrong = httpx.post(f"{srv.url}/health")  # as the router words it
    assert wrong.headers["allow"] == "GET, HEAD"
    assert wrong.json()["error"]["message"] == "POST /health: this route takes GET, HEAD"


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/v1/models", f"/v1/models/{MODEL}"])
def test_the_routes_that_read_answer_head_as_get_without_the_body(srv: InProcessServer, path: str) -> None:
    """A load balancer checking health with HEAD found a server down (405) and the router up (200)."""
    get, head = httpx.get(f"{srv.url}{path}"), httpx.head(f"{srv.url}{path}")
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == get.headers["content-length"]


def test_an_empty_model_name_is_the_served_model_as_in_vllm(srv: InProcessServer, monkeypatch) -> None:
    from kvserve.engine.input_processor import InputProcessor

    monkeypatch.setattr(srv.fake, "input_processor", InputProcessor(srv.fake.tokenizer, 256, 256))
    answer = httpx.post(f"{srv.url}/v1/completions", json={"model": "", "prompt": "a", "max_tokens": 1})
    assert answer.status_code == 200 and answer.json()["model"] == MODEL
    assert httpx.post(f"{srv.url}/tokenize", json={"model": "", "prompt": "a"}).status_code == 200
    listed = httpx.get(f"{srv.url}/v1/models/").json()
    assert listed["object"] == "list" and [card["id"] for card in listed["data"]] == [MODEL]


PREFLIGHT = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type,authorization"}


def test_a_browsers_preflight_is_answered_before_the_api_key_as_vllm_allows_any_origin() -> None:
    """A web page's client got 405 for its preflight (401 with --api-key, which a preflight never carries)."""
    server = InProcessServer(api_keys=("sesame",))
    try:
        preflight = httpx.options(f"{server.url}/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        keyed = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 1},
                           headers={"Origin": "https://chat.example", "Authorization": "Bearer sesame"})
        assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == "*"
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "a"},
                          headers={"Origin": "https://chat.example"}).status_code == 401
    finally:
        server.stop()


def test_allowed_origins_hold_other_pages_off() -> None:
    from kvserve.server.cors import CorsPolicy

    server = InProcessServer(cors=CorsPolicy(allowed_origins=("https://chat.example",)))
    try:
        allowed = httpx.options(f"{server.url}/v1/completions", headers=PREFLIGHT)
        assert allowed.headers["access-control-allow-origin"] == "https://chat.example"
        other = {**PREFLIGHT, "Origin": "https://evil.example"}
        assert httpx.options(f"{server.url}/v1/completions", headers=other).status_code == 400
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 1},
                            headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in answer.headers  # the browser withholds it from the page
    finally:
        server.stop()


@pytest.mark.parametrize("seconds", [float("nan"), -1.0])
def test_a_shutdown_timeout_is_a_number_of_seconds_not_below_zero(seconds: float) -> None:
    """NaN passed the check and drained nothing: every request was aborted at SIGTERM."""
    with pytest.raises(ValueError, match="shutdown_timeout must be >= 0"):
        ServerSettings((MODEL,), "fake-root", shutdown_timeout=seconds)
