"""The router's app against fake replicas (small HTTP servers on loopback): forwarding as sent, streams relayed
unbuffered, a client's disconnect closing the replica's connection (mid-stream, or before a non-streamed answer
came), the replica's headers relayed but the hop-by-hop ones, retries where a replica refused (or closed a
kept-alive connection unread), 502 for a replica lost mid-answer, 504 for one gone silent, 413 for a body over
the limit, 503 when none is up, bad input left to the replica to refuse, connections reused, health and
metrics."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from typing import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

import kvserve
from kvserve.router.app import Router, RouterApp
from kvserve.router.policy import make_policy
from kvserve.router.prefix_index import CHUNK_CHARS
from kvserve.router.upstream import Upstream
from kvserve.server.errors import no_route
from kvserve.server.state import DEFAULT_MAX_BODY_BYTES
from tests.router.test_upstream import CHUNKED_HEAD, ByteServer
from tests.server.conftest import free_port

LONG = "x" * CHUNK_CHARS * 3


REPLICA_PAGE = """# HELP kvserve:num_requests_waiting Requests waiting.
# TYPE kvserve:num_requests_waiting gauge
kvserve:num_requests_waiting{model_name="m"} 0.0
# HELP kvserve:prompt_tokens_total Prompt tokens.
# TYPE kvserve:prompt_tokens_total counter
kvserve:prompt_tokens_total{model_name="m"} 7.0
# HELP kvserve:time_to_first_token_seconds Time to first token.
# TYPE kvserve:time_to_first_token_seconds histogram
kvserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
kvserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2.0
kvserve:time_to_first_token_seconds_count{model_name="m"} 2.0
kvserve:time_to_first_token_seconds_sum{model_name="m"} 0.5
"""


class QuietServer(uvicorn.Server):
    def capture_signals(self):  # several in one test process: leave pytest's signal handlers alone
        return contextlib.nullcontext()


class FakeReplicas:
    """Replicas r0, r1...: HTTP servers on loopback ports (uvicorn, as real replicas run), up or down (down:
    nothing listens, so a connection is refused). /health 200, /metrics with a queue; completions echo who
    answered, after ``hold`` (if set) returns, and stream 3 events and [DONE], or ``stream_forever`` events
    (one every 10 ms) while ``streaming`` records the streams that are open."""

    def __init__(self, count: int) -> None:
        self.ports = [free_port() for _ in range(count)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.seen: list[tuple[str, dict]] = []
        self.hold: Callable[[str], Awaitable[None]] | None = None
        self.stream_forever = False
        self.unavailable: set[str] = set()  # replicas that answer completions 503 (loading, draining, failed)
        self.odd_metrics: dict[str, str] = {}  # replicas whose /metrics is this page (a proxy's error page, say)
        self.adapter_errors: dict[str, int] = {}  # replicas that refuse LoRA loads and unloads with this status
        # awaited (with the replica's url and the route) before a LoRA load or unload is taken: a slow replica
        self.adapter_hold: Callable[[str, str], Awaitable[None]] | None = None
        self.adapters: dict[str, list[str]] = {}  # each replica's loaded adapters, forgotten as it restarts
        self.reset_statuses: dict[str, int] = {}  # replicas that answer /reset_prefix_cache with this status
        self.streaming: set[int] = set()
        self.servers: dict[int, tuple[uvicorn.Server, asyncio.Task]] = {}

    async def __aenter__(self) -> FakeReplicas:
        await self.start(*range(len(self.urls)))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop(*self.servers)

    async def start(self, *indices: int) -> None:
        for i in indices:
            config = uvicorn.Config(self.app(self.urls[i]), host="127.0.0.1", port=self.ports[i],
                                    log_level="warning", lifespan="off")
            server = QuietServer(config)
            self.adapters[self.urls[i]] = []
            self.servers[i] = (server, asyncio.create_task(server.serve()))
            while not server.started:
                await asyncio.sleep(0.01)

    async def stop(self, *indices: int) -> None:
        for i in list(indices):
            server, task = self.servers.pop(i)
            server.should_exit = True
            await task

    def app(self, url: str) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse({"status": "ok"})

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            return JSONResponse({"replica": url, "auth": request.headers.get("authorization"),
                                 "data": [{"id": name} for name in ["m", *self.adapters[url]]]})

        @app.get("/v1/models/{model:path}")
        async def model(model: str) -> JSONResponse:
            return JSONResponse({"id": model, "replica": url})

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(self.odd_metrics.get(url, REPLICA_PAGE))

        @app.post("/v1/load_lora_adapter")
        @app.post("/v1/unload_lora_adapter")
        async def adapters(request: Request) -> Response:
            if self.adapter_hold is not None:
                await self.adapter_hold(url, request.url.path)
            payload = json.loads(await request.body())
            self.seen.append((url, {"path": request.url.path, **payload}))
            if url in self.adapter_errors:
                return JSONResponse({"error": {"message": "no adapter_config.json", "param": "lora_path"}},
                                    status_code=self.adapter_errors[url])
            if request.url.path == "/v1/load_lora_adapter":
                self.adapters[url].append(payload["lora_name"])
            elif payload["lora_name"] in self.adapters[url]:
                self.adapters[url].remove(payload["lora_name"])
            return PlainTextResponse("Success: LoRA adapter 'a' added successfully.")

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(request: Request) -> Response:
            self.seen.append((url, {"path": request.url.path, "query": str(request.query_params)}))
            status = self.reset_statuses.get(url, 200)
            if status != 200:
                return JSONResponse({"error": {"message": "running requests still hold cached blocks"}},
                                    status_code=status)
            return Response(status_code=200)

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        @app.post("/v1/responses")
        @app.post("/v1/messages")
        @app.post("/v1/messages/count_tokens")
        @app.post("/tokenize")
        @app.post("/v1/embeddings")
        @app.post("/pooling")
        @app.post("/score")
        @app.post("/v1/score")
        @app.post("/rerank")
        @app.post("/v1/rerank")
        @app.post("/v2/rerank")
        @app.post("/invocations")
        async def completions(request: Request) -> Response:
            payload = json.loads(await request.body())
            self.seen.append((url, payload))
            if url in self.unavailable:
                return JSONResponse({"error": {"message": "the engine failed", "code": 503}}, status_code=503)
            if self.hold is not None:
                await self.hold(url)
            if self.stream_forever:
                return StreamingResponse(self._forever(), media_type="text/event-stream")
            if payload.get("stream"):
                body = "".join(f"data: {json.dumps({'replica': url, 'i': i})}\n\n" for i in range(3))
                return StreamingResponse(iter([body, "data: [DONE]\n\n"]), media_type="text/event-stream")
            return JSONResponse({"replica": url, "auth": request.headers.get("authorization"),
                                 "api_key": request.headers.get("x-api-key")})

        return app

    async def _forever(self) -> AsyncIterator[str]:
        stream = len(self.seen)
        self.streaming.add(stream)
        try:
            for i in itertools.count():
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.01)
        finally:  # the router closed the connection: the replica's disconnect, its abort
            self.streaming.discard(stream)


def router_client(fakes: FakeReplicas, policy: str = "cache_aware") -> tuple[Router, httpx.AsyncClient]:
    router = Router(fakes.urls, make_policy(policy))
    app = RouterApp(router)
    return router, httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router")


def run(coroutine):
    return asyncio.run(coroutine)


def test_requests_with_one_prefix_land_on_one_replica() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> list[dict]:
        async with fakes:
            router, client = router_client(fakes)
            await router.health.check_all()
            answers = []
            for suffix in "abcd":
                reply = await client.post("/v1/completions", json={"prompt": LONG + suffix, "max_tokens": 1},
                                          headers={"Authorization": "Bearer k"})
                answers.append(reply.json())
            return answers

    answers = run(scenario())
    assert len({a["replica"] for a in answers}) == 1 and all(a["auth"] == "Bearer k" for a in answers)
    assert [payload["prompt"][-1] for _, payload in fakes.seen] == list("abcd")  # forwarded as sent


def test_responses_requests_are_forwarded_and_keyed_by_their_conversation() -> None:
    """/v1/responses is a generation as chat is: forwarded, streamed, and a conversation's turns go where its
    prefix is cached."""
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[list[dict], str]:
        async with fakes:
            router, client = router_client(fakes)
            await router.health.check_all()
            answers = []
            for question in "abcd":
                reply = await client.post("/v1/responses", json={"instructions": LONG, "input": question})
                answers.append(reply.json())
            streamed = await client.post("/v1/responses", json={"input": "hi", "stream": True})
            return answers, streamed.text

    answers, streamed = run(scenario())
    assert len({a["replica"] for a in answers}) == 1
    assert [payload["input"] for _, payload in fakes.seen[:4]] == list("abcd")  # forwarded as sent
    assert streamed.count("data: ") == 4 and streamed.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("path, body_of", [
    ("/v1/embeddings", lambda text: {"input": text}), ("/pooling", lambda text: {"input": [text], "task": "embed"}),
    ("/v1/embeddings", lambda text: {"messages": [{"role": "user", "content": text}]}),
    ("/score", lambda text: {"text_1": text, "text_2": ["a", "b"]}),
    ("/v1/score", lambda text: {"queries": [text], "documents": ["a"]}),
    ("/rerank", lambda text: {"query": text, "documents": ["a"]}),
    ("/v1/rerank", lambda text: {"query": text, "documents": ["a"]}),
    ("/v2/rerank", lambda text: {"query": text, "documents": ["a"]}),
])
def test_pooling_requests_are_forwarded_and_keyed_by_their_first_prompt(path: str, body_of) -> None:
    """The pooling endpoints go to a replica as generations do, those of one prefix (an embedding's input, a
    score's or rerank's query) where it is cached."""
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[list[dict], int]:
        async with fakes:
            router, client = router_client(fakes)
            await router.health.check_all()
            answers = [(await client.post(path, json=body_of(LONG + suffix))).json() for suffix in "abcd"]
            return answers, sum(len(replica.index) for replica in router.replicas)

    answers, num_keys = run(scenario())
    assert len({a["replica"] for a in answers}) == 1
    assert [payload for _, payload in fakes.seen] == [body_of(LONG + suffix) for suffix in "abcd"]  # as sent
    assert num_keys > 0  # their prompts are cached there: later ones go where they are


def test_messages_requests_are_forwarded_with_their_key_and_keyed_by_their_conversation() -> None:
    """Anthropic's /v1/messages is a generation as chat is: forwarded with the X-Api-Key its clients send (checked
    by the router as a bearer token is), a conversation's turns sent where its prefix is cached, and what the
    router answers itself there in Anthropic's error shape."""
    fakes = FakeReplicas(2)
    keyed = {"X-Api-Key": "sekret"}

    async def scenario() -> tuple[list[dict], httpx.Response, httpx.Response]:
        async with fakes:
            router = Router(fakes.urls, make_policy("cache_aware"), api_keys=("sekret",))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(RouterApp(router)), base_url="http://r")
            await router.health.check_all()
            answers = []
            for question in "abcd":
                body = {"system": LONG, "max_tokens": 4, "messages": [{"role": "user", "content": question}]}
                answers.append((await client.post("/v1/messages", json=body, headers=keyed)).json())
            refused = await client.post("/v1/messages", json={}, headers={"X-Api-Key": "wrong"})
            method = await client.get("/v1/messages", headers=keyed)
            counted = await client.post("/v1/messages/count_tokens", json={"messages": []}, headers=keyed)
            assert counted.status_code == 200 and counted.json()["api_key"] == "sekret"  # forwarded, with its key
            return answers, refused, method

    answers, refused, method = run(scenario())
    assert len({a["replica"] for a in answers}) == 1 and {a["api_key"] for a in answers} == {"sekret"}
    assert [payload["messages"][0]["content"] for _, payload in fakes.seen[:4]] == list("abcd")  # forwarded as sent
    assert refused.status_code == 401 and refused.json()["type"] == "error"
    error = refused.json()["error"]
    assert error["type"] == "authentication_error" and "X-Api-Key" in error["message"]
    assert method.status_code == 405 and method.json()["error"]["type"] == "invalid_request_error"


def test_round_robin_spreads_them() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> None:
        async with fakes:
            router, client = router_client(fakes, "round_robin")
            for suffix in "abcd":
                await client.post("/v1/completions", json={"prompt": LONG + suffix})

    run(scenario())
    assert [host for host, _ in fakes.seen] == fakes.urls * 2


def test_a_stream_is_relayed_as_the_replica_wrote_it() -> None:
    fakes = FakeReplicas(1)

    async def scenario() -> tuple[str, str]:
        async with fakes:
            router, client = router_client(fakes)
            reply = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                   "stream": True})
            return reply.headers["content-type"], reply.text

    content_type, text = run(scenario())
    assert content_type.startswith("text/event-stream")
    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")


def test_a_stream_reaches_the_client_before_the_replica_has_finished_it() -> None:
    """Unbuffered: the first event is through while the replica is still writing (it never finishes)."""
    fakes = FakeReplicas(1)
    fakes.stream_forever = True

    async def scenario() -> tuple[bytes, int]:
        async with fakes:
            relay, sent = await stream_until_first_event(Router(fakes.urls, make_policy("cache_aware")))
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay
            return sent[1]["body"], sent[0]["status"]

    first, status = run(scenario())
    assert status == 200 and first.startswith(b"data: 0\n\n")


async def stream_until_first_event(router: Router) -> tuple[asyncio.Task, list[dict]]:
    """A streamed completion relayed by ``router`` (its task, and the ASGI messages it sent), once the first
    event is through."""
    sent: list[dict] = []
    first_event = asyncio.Event()

    async def send(message: dict) -> None:
        sent.append(message)
        if message.get("body"):
            first_event.set()

    relay = asyncio.create_task(router.proxy(*asgi_request({"prompt": "p", "stream": True}), send))
    await asyncio.wait_for(first_event.wait(), 10)
    return relay, sent


def test_a_client_that_leaves_mid_stream_closes_the_replica_stream() -> None:
    """The client's http.disconnect closes the upstream connection, which a replica takes as an abort; the
    router's count of the replica's requests in flight goes back to 0."""
    fakes = FakeReplicas(1)
    fakes.stream_forever = True

    async def scenario() -> tuple[set[int], set[int], int, list[dict]]:
        async with fakes:
            router = Router(fakes.urls, make_policy("cache_aware"))
            left = asyncio.Event()
            sent: list[dict] = []

            async def send(message: dict) -> None:
                sent.append(message)
                if len(sent) == 3:  # the head and two chunks: then the client goes
                    left.set()

            scope, receive = asgi_request({"prompt": "p", "stream": True}, left)
            relay = asyncio.create_task(router.proxy(scope, receive, send))
            await asyncio.wait_for(left.wait(), 10)
            while_open = set(fakes.streaming)
            await asyncio.wait_for(relay, 10)  # the relay ends once the client has left
            for _ in range(100):
                if not fakes.streaming:
                    break
                await asyncio.sleep(0.01)
            return while_open, set(fakes.streaming), router.replicas[0].in_flight, sent

    while_open, after, in_flight, sent = run(scenario())
    assert while_open and not after, (while_open, after)
    assert in_flight == 0 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def asgi_request(payload: dict, left: asyncio.Event | None = None) -> tuple[dict, Callable]:
    """An ASGI scope and receive for a POST /v1/completions with ``payload``; receive then waits for
    ``left`` (forever if None) and says http.disconnect."""
    body = json.dumps(payload).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await (left or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    return scope, receive


def test_a_refusing_replica_is_marked_down_and_the_request_served_elsewhere() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[dict, Router]:
        await fakes.start(1)  # r0 down: nothing listens on its port
        try:
            router, client = router_client(fakes)
            router.replicas[1].in_flight = 5  # r0 is the least loaded: the first choice
            reply = await client.post("/v1/completions", json={"prompt": "p"})
            return reply.json(), router
        finally:
            await fakes.stop(1)

    answer, router = run(scenario())
    assert answer["replica"] == fakes.urls[1] and not router.replicas[0].healthy
    assert router.metrics.retries._value.get() == 1


def test_a_503_from_a_replica_sends_the_request_to_another_and_the_last_one_is_passed_on() -> None:
    """A replica that answers 503 (loading, draining, its engine failed) started nothing: another serves it."""
    fakes = FakeReplicas(2)
    fakes.unavailable.add(fakes.urls[0])

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with fakes:
            router, client = router_client(fakes)
            router.replicas[1].in_flight = 5  # r0 is the least loaded: the first choice
            served = await client.post("/v1/completions", json={"prompt": "p"})
            fakes.unavailable.add(fakes.urls[1])
            return served, await client.post("/v1/completions", json={"prompt": "p"})

    served, passed_on = run(scenario())
    assert served.json()["replica"] == fakes.urls[1]
    assert passed_on.status_code == 503 and passed_on.json()["error"]["message"] == "the engine failed"


def answer_of(fakes: FakeReplicas, send: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]) -> httpx.Response:
    """The router's answer to one request ``send`` makes, in front of ``fakes``."""
    async def scenario() -> httpx.Response:
        async with fakes:
            _, client = router_client(fakes)
            return await send(client)

    return run(scenario())


def test_tokenize_goes_through_to_a_replica() -> None:
    fakes = FakeReplicas(1)
    reply = answer_of(fakes, lambda client: client.post("/tokenize", json={"prompt": "p"}))
    assert reply.status_code == 200 and reply.json()["replica"] == fakes.urls[0]
    assert fakes.seen == [(fakes.urls[0], {"prompt": "p"})]


def test_the_model_list_is_asked_with_the_clients_key() -> None:
    """Replicas started with --api-key want it on /v1/models too: the router asked with no headers at all, so the
    list was a 401 whatever key the client sent (the SDK's models.list(), tools probing it)."""
    fakes = FakeReplicas(1)
    reply = answer_of(fakes, lambda client: client.get("/v1/models", headers={"Authorization": "Bearer sekret"}))
    assert reply.status_code == 200
    assert (reply.json()["replica"], reply.json()["auth"]) == (fakes.urls[0], "Bearer sekret")


def test_no_replica_up_is_a_503_with_retry_after_and_the_router_stays_up() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        router, client = router_client(fakes)
        await router.health.check_all()
        refused = await client.post("/v1/completions", json={"prompt": "p"})
        health = await client.get("/health")
        async with fakes:
            await router.health.check_all()  # the replicas are back: used again
            return refused, health, await client.post("/v1/completions", json={"prompt": "p"})

    refused, health, again = run(scenario())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == 503 and health.status_code == 503
    assert again.status_code == 200


def test_a_replica_lost_with_the_request_in_flight_is_a_502_and_marked_down() -> None:
    fakes = FakeReplicas(1)

    async def scenario() -> tuple[httpx.Response, bool, httpx.Response]:
        async with fakes:
            router, client = router_client(fakes)

            async def die(url: str) -> None:  # the replica's process goes: its connections reset
                server, _ = fakes.servers[0]
                for connection in list(server.server_state.connections):
                    connection.transport.abort()

            fakes.hold = die
            lost = await client.post("/v1/completions", json={"prompt": "p"})
            fakes.hold = None
            healthy_after = router.replicas[0].healthy
            await router.health.check_all()
            return lost, healthy_after, await client.post("/v1/completions", json={"prompt": "p"})

    lost, healthy_after, again = run(scenario())
    assert lost.status_code == 502 and "failed" in lost.json()["error"]["message"] and not healthy_after
    assert again.status_code == 200


def test_metrics_count_requests_and_prefix_hits_per_replica() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> str:
        async with fakes:
            router, client = router_client(fakes)
            for _ in range(3):
                await client.post("/v1/completions", json={"prompt": LONG})
            return (await client.get("/metrics")).text

    text = run(scenario())
    assert f'kvserve_router:requests_total{{replica="{fakes.urls[0]}"}} 3.0' in text
    assert f'kvserve_router:prefix_hit_chunks_total{{replica="{fakes.urls[0]}"}} 6.0' in text  # 3 chunks, twice
    assert 'kvserve_router:decisions_total{reason="prefix"} 2.0' in text


def test_connections_to_a_replica_are_reused() -> None:
    fakes = FakeReplicas(1)

    async def scenario() -> tuple[int, list[int]]:
        async with fakes:
            router, client = router_client(fakes)
            for stream in (False, True, False, True):
                reply = await client.post("/v1/completions", json={"prompt": "p", "stream": stream})
                assert reply.status_code == 200
            server, _ = fakes.servers[0]
            return server.server_state.total_requests, [len(s) for s in router.upstream._idle.values()]

    total_requests, idle = run(scenario())
    assert total_requests == 4 and idle == [1]  # four requests, one connection


def test_a_moved_replica_is_a_fresh_entry_until_its_health_check() -> None:
    router = Router(["http://a:1", "http://b:1"], make_policy("cache_aware"))
    router.replicas[0].index.insert([b"k"])
    router.move("http://a:1/", "http://c:2")
    moved = router.replicas[0]
    assert (moved.url, moved.healthy, moved.index.match([b"k"])) == ("http://c:2", False, 0)
    with pytest.raises(ValueError, match="no replica at http://zz"):
        router.move("http://zz", "http://c:3")


def test_a_burst_sees_the_load_and_prefix_of_requests_still_waiting_for_headers() -> None:
    """Replicas that answer only once the whole burst has arrived: each decision must count the requests
    routed before it, or the burst all lands on the first replica."""
    fakes, num_requests = FakeReplicas(2), 20
    arrived: list[str] = []
    all_arrived = asyncio.Event()

    async def hold(url: str) -> None:
        arrived.append(url)
        if len(arrived) == num_requests:
            all_arrived.set()
        await all_arrived.wait()

    fakes.hold = hold

    async def scenario() -> None:
        async with fakes:
            router, client = router_client(fakes)
            body = {"model": "m", "prompt": LONG}
            answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(num_requests)))
            assert all(answer.status_code == 200 for answer in answers)

    run(scenario())
    counts = {url: arrived.count(url) for url in fakes.urls}
    r0, r1 = fakes.urls
    assert counts[r0] == 9 + 1 and counts[r1] == 10, counts  # r0 by prefix until 9 ahead, then the two alternate


def test_a_replica_lost_mid_stream_ends_the_stream_with_an_error_event() -> None:
    """The status went out as 200 with the first event: the client learns of the failure from an error event
    in OpenAI's shape and [DONE], not from a stream that merely stops; the replica is marked down."""
    fakes = FakeReplicas(1)
    fakes.stream_forever = True

    async def scenario() -> tuple[list[dict], bool]:
        async with fakes:
            router = Router(fakes.urls, make_policy("cache_aware"))
            relay, sent = await stream_until_first_event(router)
            server, _ = fakes.servers[0]
            for connection in list(server.server_state.connections):  # the replica's process goes
                connection.transport.abort()
            await asyncio.wait_for(relay, 10)
            return sent, router.replicas[0].healthy

    sent, healthy = run(scenario())
    *_, failure, end = sent
    assert end == {"type": "http.response.body", "body": b"", "more_body": False} and not healthy
    error_event, done = failure["body"].decode().split("\n\n", 1)
    assert json.loads(error_event.removeprefix("data: "))["error"]["code"] == 502 and done == "data: [DONE]\n\n"


def json_answer(content: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(content), content)


def test_a_request_on_a_kept_alive_connection_to_a_replica_just_dead_goes_to_another() -> None:
    """Right after a replica dies, a request written onto its kept-alive connection (its close not yet seen)
    was never started there: it is served by a live replica, not answered 502."""
    dying = ByteServer(json_answer(b'{"r": 0}'), num_answers=1)  # closes a connection's second request unread
    live = ByteServer(json_answer(b'{"r": 1}'))

    async def scenario() -> tuple[list[tuple[int, dict]], bool]:
        async with dying as dying_origin, live as live_origin:
            urls = [f"http://127.0.0.1:{origin.port}" for origin in (dying_origin, live_origin)]
            router = Router(urls, make_policy("round_robin"))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(RouterApp(router)), base_url="http://r")
            answers = []
            for i in range(3):
                if i == 2:
                    dying.server.close()  # it dies: listens no more; its kept-alive connection still looks open
                reply = await client.post("/v1/completions", json={"prompt": "p"})
                answers.append((reply.status_code, reply.json()))
            return answers, router.replicas[0].healthy

    answers, dying_healthy = run(scenario())
    assert answers == [(200, {"r": 0}), (200, {"r": 1}), (200, {"r": 1})] and not dying_healthy


def silent_router(origin_port: int) -> Router:
    return Router([f"http://127.0.0.1:{origin_port}"], make_policy("cache_aware"), Upstream(response_timeout=0.2))


def test_a_replica_that_sends_no_answer_is_a_504_after_the_timeout() -> None:
    """A stopped or deadlocked replica holds no request forever: a 504 in OpenAI's shape; the replica is left
    to the health checks (a slow one is not marked down)."""
    server = ByteServer([])

    async def scenario() -> tuple[httpx.Response, Router]:
        async with server as origin:
            router = silent_router(origin.port)
            client = httpx.AsyncClient(transport=httpx.ASGITransport(RouterApp(router)), base_url="http://r")
            return await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "p"}), 10), router

    reply, router = run(scenario())
    error = reply.json()["error"]
    assert reply.status_code == 504 and error["code"] == 504 and "stopped answering" in error["message"]
    assert router.replicas[0].healthy and router.replicas[0].in_flight == 0


def test_a_stream_from_a_replica_gone_silent_ends_with_an_error_event() -> None:
    server = ByteServer(CHUNKED_HEAD + b"9\r\ndata: 0\n\n\r\n")  # one event, then nothing

    async def scenario() -> list[dict]:
        async with server as origin:
            relay, sent = await stream_until_first_event(silent_router(origin.port))
            await asyncio.wait_for(relay, 10)
            return sent

    *_, failure, end = run(scenario())
    assert end == {"type": "http.response.body", "body": b"", "more_body": False}
    error_event, done = failure["body"].decode().split("\n\n", 1)
    assert json.loads(error_event.removeprefix("data: "))["error"]["code"] == 504 and done == "data: [DONE]\n\n"


def body_request(pieces: list[bytes], content_length: int | None) -> tuple[dict, Callable, list[int]]:
    """An ASGI scope and receive for a POST whose body comes in ``pieces`` (more of them after the last, for
    ever: a chunked body that never ends); and the count of receive() calls."""
    headers = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", b"%d" % content_length))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    num_received = [0]

    async def receive() -> dict:
        num_received[0] += 1
        return {"type": "http.request", "body": pieces[min(num_received[0], len(pieces)) - 1], "more_body": True}

    return scope, receive, num_received


async def proxy_status(router: Router, scope: dict, receive: Callable) -> tuple[int, dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(router.proxy(scope, receive, send), 10)
    return sent[0]["status"], json.loads(sent[1]["body"])


@pytest.mark.parametrize("content_length, num_reads", [(101, 0), (None, 2)])
def test_a_body_over_the_limit_is_a_413_before_more_of_it_is_read(content_length: int | None,
                                                                   num_reads: int) -> None:
    """A declared length over the limit is refused at once, a chunked body once what came passes it; the
    replica (here none listens) is never asked."""
    router = Router([f"http://127.0.0.1:{free_port()}"], make_policy("cache_aware"), max_body_bytes=100)
    scope, receive, num_received = body_request([b"x" * 64], content_length)
    status, body = run(proxy_status(router, scope, receive))
    assert (status, num_received[0]) == (413, num_reads)
    assert body["error"] == {"message": "the request body is over the limit of 100 bytes",
                             "type": "invalid_request_error", "param": None, "code": 413}


def test_a_body_at_the_limit_is_forwarded() -> None:
    fakes = FakeReplicas(1)
    body = json.dumps({"prompt": "p"}).encode()

    async def scenario() -> httpx.Response:
        async with fakes:
            router = Router(fakes.urls, make_policy("cache_aware"), max_body_bytes=len(body))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(RouterApp(router)), base_url="http://r")
            return await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})

    assert run(scenario()).status_code == 200
    assert Router(fakes.urls, make_policy("cache_aware")).max_body_bytes == DEFAULT_MAX_BODY_BYTES
    with pytest.raises(ValueError, match="--max-body-bytes must be >= 1"):
        Router(fakes.urls, make_policy("cache_aware"), max_body_bytes=0)


def test_answers_given_before_the_body_is_read_close_the_connection(monkeypatch) -> None:
    """As the replicas answer: a body sent a byte at a time held the router's connection forever, and after its
    408 (or a 413, or a 401) uvicorn read and dropped the rest of the body for as long as it came."""
    from kvserve.server import request_body

    monkeypatch.setattr(request_body, "BODY_SECONDS", 0.1)
    fakes = FakeReplicas(1)

    async def trickle() -> dict:
        await asyncio.sleep(1)
        return {"type": "http.request", "body": b"{", "more_body": True}

    async def scenario() -> list[tuple[int, list[tuple[bytes, bytes]], bytes]]:
        async with fakes:
            answers = []
            for keys, headers, receive in [((), [(b"content-length", b"100")], trickle),
                                           ((), [(b"content-length", b"99999999")], trickle),
                                           ((), [(b"content-encoding", b"br")], trickle),
                                           (("sekret",), [], trickle)]:
                app = RouterApp(Router(fakes.urls, make_policy("cache_aware"), api_keys=keys))
                scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
                answers.append(await _asgi_answer(app, scope, receive))
            return answers

    (timeout, too_large, coded, no_key) = run(scenario())
    assert timeout[0] == 408 and b"did not come whole within 0.1 s" in timeout[2]
    assert too_large[0] == 413 and coded[0] == 415 and no_key[0] == 401
    assert all((b"connection", b"close") in answer[1] for answer in (timeout, too_large, coded, no_key))


async def _asgi_answer(app: RouterApp, scope: dict, receive) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``app``'s answer to ``scope``: its status, headers and body."""
    messages = []

    async def send(message: dict) -> None:
        messages.append(message)

    await app(scope, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    return start["status"], start["headers"], b"".join(m.get("body", b"") for m in messages[1:])


def test_with_a_key_the_router_refuses_a_request_without_it_before_reading_its_body() -> None:
    """The replicas checked the key, but only after the router had read, parsed and hashed the body into its
    prefix index (a 4 MiB body: 68 ms of its event loop) and forwarded it."""
    fakes = FakeReplicas(1)

    async def scenario() -> list[httpx.Response]:
        async with fakes:
            router = Router(fakes.urls, make_policy("cache_aware"), api_keys=("sekret", "rotated"))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(RouterApp(router)), base_url="http://r")
            return [await client.post("/v1/completions", json={"prompt": "p"}),
                    await client.get("/v1/models"),
                    await client.post("/v1/completions", json={"prompt": "p"},
                                      headers={"Authorization": "Bearer sekret"}),
                    await client.get("/health"),
                    await client.get("/v1/models/m"),
                    await client.get("/v1/nope"),
                    await client.post("/v1/completions", json={"prompt": "q"},
                                      headers={"Authorization": "Bearer rotated"})]

    refused, models, served, health, model, unknown, rotated = run(scenario())
    assert refused.status_code == models.status_code == model.status_code == unknown.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert served.status_code == 200 and served.json()["auth"] == "Bearer sekret" and health.status_code == 200
    assert rotated.status_code == 200 and rotated.json()["auth"] == "Bearer rotated"  # either key
    assert [payload for _, payload in fakes.seen] == [{"prompt": "p"}, {"prompt": "q"}]  # none refused reached one


async def until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_a_client_that_leaves_before_a_non_streamed_answer_closes_the_replica_connection() -> None:
    """A non-streamed answer's head comes only once its generation is done: a client that leaves before then
    closes the upstream connection (the replica's abort) at once; the router did not watch the client until the
    head came, so an abandoned request ran to its end on the replica."""
    server = ByteServer([])  # reads the request and never answers: a replica still generating

    async def scenario() -> tuple[list[dict], int]:
        async with server as origin:
            router = Router([f"http://127.0.0.1:{origin.port}"], make_policy("cache_aware"))
            left, sent = asyncio.Event(), []
            scope, receive = asgi_request({"prompt": "p"}, left)
            relay = asyncio.create_task(router.proxy(scope, receive, sent_to(sent)))
            await until(lambda: server.requests)
            left.set()
            await asyncio.wait_for(relay, 5)
            await asyncio.wait_for(asyncio.gather(*server.handlers), 5)  # the replica read its connection's end
            return sent, router.replicas[0].in_flight

    sent, in_flight = run(scenario())
    assert sent == [] and in_flight == 0


def sent_to(sent: list[dict]) -> Callable[[dict], Awaitable[None]]:
    async def send(message: dict) -> None:
        sent.append(message)

    return send


HOP_BY_HOP = b"connection: keep-alive, x-hop\r\nkeep-alive: timeout=5\r\nx-hop: 1\r\n"
END_TO_END = b"retry-after: 1\r\nx-end: a\r\nx-end: b\r\n"


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n" + END_TO_END + HOP_BY_HOP
    + b"content-length: 2\r\n\r\n{}",
    CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\n" + END_TO_END + HOP_BY_HOP + b"\r\n") + b"9\r\ndata: 0\n\n\r\n0\r\n\r\n",
], ids=["503", "stream"])
def test_the_replicas_headers_reach_the_client_but_the_hop_by_hop_ones(answer: bytes) -> None:
    """A replica's 503 asks the client to come back after Retry-After: the router passed on content-type only.
    Hop-by-hop headers (RFC 9110 section 7.6.1: connection, those it names, keep-alive, transfer-encoding) are
    the router's own connection's business; content-length is the router's, which frames the body anew."""
    server = ByteServer(answer)

    async def scenario() -> list[dict]:
        async with server as origin:
            router = Router([f"http://127.0.0.1:{origin.port}"], make_policy("cache_aware"))
            sent: list[dict] = []
            scope, receive = asgi_request({"prompt": "p"}, asyncio.Event())
            await asyncio.wait_for(router.proxy(scope, receive, sent_to(sent)), 5)
            return sent

    start, *_ = run(scenario())
    names = [name for name, _ in start["headers"]]
    assert (b"retry-after", b"1") in start["headers"] and names.count(b"x-end") == 2
    assert not {b"connection", b"keep-alive", b"x-hop", b"transfer-encoding"} & set(names)
    if start["status"] == 503:
        assert (b"content-type", b"application/json") in start["headers"] and (b"content-length", b"2") in start[
            "headers"]
    else:
        assert (b"content-type", b"text/event-stream") in start["headers"] and b"content-length" not in names


def test_a_model_card_is_asked_of_a_replica() -> None:
    """GET /v1/models/{model} (the SDK's models.retrieve) was a 404 "no route"; a model's name may hold
    slashes and any character."""
    fakes = FakeReplicas(1)
    reply = answer_of(fakes, lambda client: client.get("/v1/models/org/m%201%3F"))
    assert reply.status_code == 200 and reply.json() == {"id": "org/m 1?", "replica": fakes.urls[0]}


@pytest.mark.parametrize("payload", [
    {"prompt": "\ud800" + LONG},
    {"messages": [{"role": "user", "content": LONG + "\udfff" + LONG}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
], ids=["surrogate-prompt", "surrogate-message", "number-text", "null-text"])
def test_bad_text_goes_to_a_replica_to_refuse(payload: dict) -> None:
    """A lone surrogate (which a replica refuses with its 400) or a content part's text that is no string
    crashed the router's prompt keying: a plain-text 500."""
    fakes = FakeReplicas(1)
    reply = answer_of(fakes, lambda client: client.post("/v1/chat/completions", content=json.dumps(payload),
                                                        headers={"content-type": "application/json"}))
    assert reply.status_code == 200 and fakes.seen == [(fakes.urls[0], payload)]


def error_answer(status: int, message: bytes) -> bytes:
    content = b'{"error": {"message": "%s", "code": %d}}' % (message, status)
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status, len(content), content)


@pytest.mark.parametrize("answer, path, num_keys", [
    (error_answer(400, b"too long"), "/v1/completions", 0), (json_answer(b"{}"), "/v1/completions", 3),
    (json_answer(b"{}"), "/tokenize", 0)], ids=["400", "200", "tokenize"])
def test_the_keys_of_a_request_that_cached_nothing_leave_its_index(answer: bytes, path: str, num_keys: int) -> None:
    """A refused request caches nothing there, nor does a /tokenize: their keys only crowded out the keys of
    prompts that are cached (17 over-long prompts flushed a replica's whole index)."""
    server = ByteServer(answer)

    async def scenario() -> int:
        async with server as origin:
            router = Router([f"http://127.0.0.1:{origin.port}"], make_policy("cache_aware"))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(RouterApp(router)), base_url="http://r")
            await client.post(path, json={"prompt": LONG})
            return len(router.replicas[0].index)

    assert run(scenario()) == num_keys


def test_request_ids_and_trace_context_reach_the_replica() -> None:
    server = ByteServer(json_answer(b"{}"))
    sent = {"x-request-id": "my-req-42", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate": "vendor=1"}

    async def scenario() -> None:
        async with server as origin:
            router = Router([f"http://127.0.0.1:{origin.port}"], make_policy("cache_aware"))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(RouterApp(router)), base_url="http://r")
            await client.post("/v1/completions", json={"prompt": "p"}, headers=sent)

    run(scenario())
    head = server.requests[0].decode().split("\r\n\r\n")[0]
    assert all(f"\r\n{name}: {value}" in head for name, value in sent.items()), head


def test_every_answer_carries_the_clients_request_id_once() -> None:
    """A replica's answer carries it already (relayed as it came); what the router answers itself, a 404 or a 503
    with no replica up, gets it from the router, as a replica's own errors do."""
    echoed = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-request-id: my-req-42\r\ncontent-length: 2\r\n\r\n{}"
    server = ByteServer(echoed)
    headers = {"X-Request-Id": "my-req-42"}

    async def scenario() -> list[httpx.Response]:
        async with server as origin:
            router = Router([f"http://127.0.0.1:{origin.port}"], make_policy("cache_aware"))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(RouterApp(router)), base_url="http://r")
            relayed = await client.post("/v1/completions", json={"prompt": "p"}, headers=headers)
        _, nobody_up = router_client(FakeReplicas(1))
        return [relayed, await nobody_up.get("/nope", headers=headers),
                await nobody_up.post("/v1/completions", json={"prompt": "p"}, headers=headers)]

    for answer, status in zip(run(scenario()), (200, 404, 503)):
        assert answer.status_code == status
        assert answer.headers.get_list("x-request-id") == ["my-req-42"]


@pytest.mark.parametrize("body", [b"{nope", b"[1, 2]", b""])
def test_a_body_that_is_no_json_object_goes_to_a_replica_to_refuse_in_its_words(body: bytes) -> None:
    """The router answered these 400s itself, worded unlike a replica (which names the field, as pydantic does)."""
    server = ByteServer(error_answer(400, b"the replica's words"))

    async def scenario() -> httpx.Response:
        async with server as origin:
            router = Router([f"http://127.0.0.1:{origin.port}"], make_policy("cache_aware"))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(RouterApp(router)), base_url="http://r")
            return await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})

    reply = run(scenario())
    assert reply.status_code == 400 and reply.json()["error"]["message"] == "the replica's words"
    assert server.requests[0].endswith(b"\r\n\r\n" + body)


def test_what_the_router_answers_in_a_replicas_place_is_worded_as_a_replica_words_it() -> None:
    """404, 405 and the redirect of a trailing slash, as a replica's FastAPI answers them."""
    async def scenario() -> list[httpx.Response]:
        _, client = router_client(FakeReplicas(1))  # none up: these never reach one
        return [await client.get("/nope"), await client.get("/v1/completions"), await client.post("/health"),
                await client.post("/v1/completions/?a=1", json={})]

    missing, get_a_post, post_a_get, slash = run(scenario())
    assert (missing.status_code, missing.json()["error"]["message"]) == (404, no_route("GET", "/nope"))
    assert missing.json()["error"]["message"].startswith("kvserve serves no GET /nope (it serves /v1/completions")
    assert (get_a_post.status_code, get_a_post.json()["error"]["message"]) == (
        405, "GET /v1/completions: this route takes POST")
    assert get_a_post.headers["allow"] == "POST" and post_a_get.headers["allow"] == "GET, HEAD"
    assert post_a_get.json()["error"]["message"] == "POST /health: this route takes GET, HEAD"
    assert (slash.status_code, slash.headers["location"]) == (307, "http://router/v1/completions?a=1")


def test_metrics_show_each_replicas_own_metrics_while_it_is_up() -> None:
    """One server's /metrics has the engine's kvserve:* metrics; behind the router (serve --data-parallel-size)
    they were on the replicas' ports only, so dashboards went empty when a deployment scaled out."""
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[str, str]:
        async with fakes:
            router, client = router_client(fakes)
            await router.health.check_all()
            both = (await client.get("/metrics")).text
            await fakes.stop(1)
            await router.health.check_all()
            return both, (await client.get("/metrics")).text

    both, one = run(scenario())
    families = {family.name: family for family in text_string_to_metric_families(both)}
    for url in fakes.urls:
        assert f'kvserve:prompt_tokens_total{{model_name="m",replica="{url}"}} 7.0' in both
        assert f'kvserve:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m",replica="{url}"}} 2.0' in both
    assert families["kvserve:time_to_first_token_seconds"].type == "histogram"
    assert both.count("# TYPE kvserve:num_requests_waiting gauge") == 1
    assert f'replica="{fakes.urls[0]}"' in one and f'replica="{fakes.urls[1]}"}} 7.0' not in one  # r1 is down


def test_version_is_the_packages_as_on_a_replica() -> None:
    fakes = FakeReplicas(1)

    async def scenario() -> httpx.Response:
        async with fakes:
            _, client = router_client(fakes)
            return await client.get("/version")

    answer = run(scenario())
    assert answer.status_code == 200 and answer.json() == {"version": kvserve.__version__}


@pytest.mark.parametrize("page", ["<html><body>502 Bad Gateway</body></html>",
                                  "kvserve:num_requests_waiting NaN\n", "kvserve:num_requests_running +Inf\n"])
def test_a_metrics_page_that_does_not_read_leaves_the_load_unknown_and_the_checks_going(page: str, caplog) -> None:
    """A proxy's HTML page in place of /metrics (or a queue of NaN) raised out of the health-check loop, which no
    one awaited: the checks stopped unlogged, a dead replica read healthy and a replica marked down never came
    back."""
    fakes = FakeReplicas(1)
    fakes.odd_metrics[fakes.urls[0]] = page

    async def scenario() -> list[bool]:
        async with fakes:
            router, _ = router_client(fakes)
            router.health.interval = 0.01
            (replica,) = router.replicas
            loop = asyncio.create_task(router.health.loop())
            seen = []
            for change in (None, lambda: fakes.stop(0), lambda: fakes.start(0)):
                if change is not None:
                    await change()
                await asyncio.sleep(0.3)
                seen.append(replica.healthy)
            assert replica.reported_load == 0 and not loop.done()
            loop.cancel()
            return seen

    with caplog.at_level("INFO", logger="kvserve.router.health"):
        assert run(scenario()) == [True, False, True]
    lines = [record.getMessage() for record in caplog.records]
    assert sum("does not read" in line for line in lines) == 1, lines  # said once until a page reads
    assert [line.rsplit(" is ", 1)[1] for line in lines if " is " in line and "page" not in line] == [
        "up", "down", "back up"]


def test_a_round_that_fails_is_logged_and_the_next_comes(caplog, monkeypatch) -> None:
    fakes = FakeReplicas(1)

    async def scenario() -> int:
        router, _ = router_client(fakes)
        router.health.interval = 0.01
        rounds = 0

        async def failing() -> None:
            nonlocal rounds
            rounds += 1
            raise RuntimeError("a bug in a round")

        monkeypatch.setattr(router.health, "check_all", failing)
        loop = asyncio.create_task(router.health.loop())
        await asyncio.sleep(0.1)
        loop.cancel()
        return rounds

    with caplog.at_level("ERROR", logger="kvserve.router.health"):
        assert run(scenario()) > 2
    assert all("a round of health checks failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_relayed_answer_varies_by_origin_once() -> None:
    """A replica's `Vary: Origin` was relayed and the router's CORS layer (the replicas' policy) added its own:
    "Vary: Origin, Origin" on every answer."""
    from kvserve.router.launch import router_app
    from kvserve.server.cors import CorsPolicy

    server = ByteServer(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nvary: Origin\r\ncontent-length: 2"
                        b"\r\n\r\n{}")

    async def scenario() -> httpx.Response:
        async with server as origin:
            router = Router([f"http://127.0.0.1:{origin.port}"], make_policy("cache_aware"))
            app = router_app(router, CorsPolicy())
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://r")
            return await client.post("/v1/completions", json={"prompt": "p"}, headers={"Origin": "https://a.example"})

    reply = run(scenario())
    assert reply.status_code == 200 and reply.headers.get_list("vary") == ["Origin"]


LOAD = {"lora_name": "a", "lora_path": "/adapters/a"}


def test_a_lora_load_and_unload_reach_every_replica() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with fakes:
            _, client = router_client(fakes)
            loaded = await client.post("/v1/load_lora_adapter", json=LOAD)
            unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
            return loaded, unloaded, await client.get("/v1/load_lora_adapter")

    loaded, unloaded, got = run(scenario())
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'a' added successfully.")
    assert unloaded.status_code == 200 and got.status_code == 405
    expected = [(url, {"path": "/v1/load_lora_adapter", **LOAD}) for url in fakes.urls] + \
        [(url, {"path": "/v1/unload_lora_adapter", "lora_name": "a"}) for url in fakes.urls]
    assert sorted(fakes.seen, key=repr) == sorted(expected, key=repr)


def test_a_load_refused_by_one_replica_names_it_and_is_unloaded_from_the_others() -> None:
    fakes = FakeReplicas(3)
    fakes.adapter_errors[fakes.urls[1]] = 400
    reply = answer_of(fakes, lambda client: client.post("/v1/load_lora_adapter", json=LOAD))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "lora_path"
    assert error["message"] == (f"replica {fakes.urls[1]}: no adapter_config.json (unloaded again from "
                                f"{fakes.urls[0]}, {fakes.urls[2]})")
    unloads = sorted(url for url, payload in fakes.seen if payload["path"] == "/v1/unload_lora_adapter")
    assert unloads == sorted([fakes.urls[0], fakes.urls[2]])


def test_a_replica_down_fails_the_load_naming_it_and_the_unload_says_where_it_was_done() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with fakes:
            _, client = router_client(fakes)
            await fakes.stop(1)
            loaded = await client.post("/v1/load_lora_adapter", json=LOAD)
            return loaded, await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})

    loaded, unloaded = run(scenario())
    assert loaded.status_code == 502 and unloaded.status_code == 502
    assert loaded.json()["error"]["message"].startswith(f"replica {fakes.urls[1]}: not reachable: ")
    assert loaded.json()["error"]["message"].endswith(f"(unloaded again from {fakes.urls[0]})")
    assert unloaded.json()["error"]["message"].endswith(f"(unloaded from {fakes.urls[0]})")


def test_lora_updates_reach_every_replica_in_one_order() -> None:
    """An unload sent while a load is still at a slow replica waits for it: else the slow replica took the unload
    first (a 404) and the load after, the one replica left serving the adapter."""
    fakes = FakeReplicas(2)
    slow, loaded = fakes.urls[1], asyncio.Event()

    async def hold(url: str, path: str) -> None:
        if url == slow and path == "/v1/load_lora_adapter":
            await loaded.wait()

    fakes.adapter_hold = hold

    async def scenario() -> None:
        async with fakes:
            _, client = router_client(fakes)
            load = asyncio.create_task(client.post("/v1/load_lora_adapter", json=LOAD))
            await until(lambda: fakes.seen)
            unload = asyncio.create_task(client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}))
            await asyncio.sleep(0.2)
            loaded.set()
            assert [(await load).status_code, (await unload).status_code] == [200, 200]

    run(scenario())
    for url in fakes.urls:
        assert [payload["path"] for seen_by, payload in fakes.seen if seen_by == url] == \
            ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]


def test_a_replica_that_comes_back_gets_the_runtime_loads_replayed_in_order_before_it_serves() -> None:
    """A restarted replica knows only its --lora-modules: the loads every replica took are sent to it again, in
    load order, before a health check routes to it; an unloaded adapter is not, nor one it serves already."""
    fakes = FakeReplicas(2)
    back = fakes.urls[1]

    async def scenario() -> tuple[list[str], list[bool], list[str]]:
        async with fakes:
            router, client = router_client(fakes)
            await router.health.check_all()
            for name in "bac":
                await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/adapters/{name}"})
            await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
            await fakes.stop(1)
            await router.health.check_all()
            down = [replica.healthy for replica in router.replicas]
            await fakes.start(1)
            fakes.seen.clear()
            await router.health.check_all()
            await router.health.check_all()  # up already: nothing replayed again
            replayed = [payload["lora_name"] for url, payload in fakes.seen if url == back]
            return replayed, down + [replica.healthy for replica in router.replicas], fakes.adapters[back]

    replayed, health, served = run(scenario())
    assert replayed == ["b", "c"]
    assert health == [True, False, True, True]
    assert served == ["b", "c"]


def test_a_replica_that_fails_a_replay_stays_out_of_rotation_until_one_succeeds(caplog) -> None:
    fakes = FakeReplicas(2)
    back = fakes.urls[1]

    async def scenario() -> tuple[bool, list[dict], bool]:
        async with fakes:
            router, client = router_client(fakes)
            await client.post("/v1/load_lora_adapter", json=LOAD)
            router.health.mark_down(router.replicas[1])
            await fakes.stop(1)
            await fakes.start(1)
            fakes.adapter_errors[back] = 400
            await router.health.check_all()
            kept_out = router.replicas[1].healthy
            answers = [(await client.post("/v1/completions", json={"prompt": str(i)})).json() for i in range(4)]
            del fakes.adapter_errors[back]
            await router.health.check_all()
            return kept_out, answers, router.replicas[1].healthy

    kept_out, answers, back_in = run(scenario())
    assert not kept_out and back_in
    assert all(answer["replica"] == fakes.urls[0] for answer in answers)
    assert f"replica {back} is kept out of rotation: loading LoRA adapter 'a' again failed (400: " \
        "no adapter_config.json)" in caplog.text


def test_a_replica_marked_down_that_kept_its_adapters_is_not_sent_them_again() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[list, bool]:
        async with fakes:
            router, client = router_client(fakes)
            await client.post("/v1/load_lora_adapter", json=LOAD)
            fakes.seen.clear()
            router.health.mark_down(router.replicas[1])
            await router.health.check_all()
            return fakes.seen, router.replicas[1].healthy

    assert run(scenario()) == ([], True)


def test_a_prefix_cache_reset_reaches_every_replica_and_empties_the_routers_guess_of_their_caches() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[Router, httpx.Response, httpx.Response]:
        async with fakes:
            router, client = router_client(fakes)
            await client.post("/v1/completions", json={"prompt": LONG})
            assert sum(len(replica.index) for replica in router.replicas) > 0
            reset = await client.post("/reset_prefix_cache?reset_external=true")
            return router, reset, await client.get("/reset_prefix_cache")

    router, reset, got = run(scenario())
    assert reset.status_code == 200 and got.status_code == 405
    resets = [seen for seen in fakes.seen if seen[1].get("path") == "/reset_prefix_cache"]
    assert sorted(resets) == [(url, {"path": "/reset_prefix_cache", "query": "reset_external=true"})
                              for url in sorted(fakes.urls)]
    assert [len(replica.index) for replica in router.replicas] == [0, 0]


def test_a_reset_one_replica_could_not_finish_is_its_answer_naming_it() -> None:
    fakes = FakeReplicas(2)
    fakes.reset_statuses[fakes.urls[1]] = 409
    reply = answer_of(fakes, lambda client: client.post("/reset_prefix_cache"))
    assert reply.status_code == 409
    assert reply.json()["error"]["message"] == f"replica {fakes.urls[1]}: running requests still hold cached blocks"


def test_sagemakers_ping_and_invocations_go_as_health_and_a_generation_do() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[Router, list[httpx.Response]]:
        async with fakes:
            router, client = router_client(fakes)
            pings = [await client.request(method, "/ping") for method in ("GET", "POST")]
            invoked = [await client.post("/invocations", json={"messages": [{"role": "user", "content": LONG}]})
                       for _ in range(2)]
            return router, pings + invoked

    router, (got, posted, first, second) = run(scenario())
    assert got.status_code == posted.status_code == 200 and posted.json()["replicas_up"] == fakes.urls
    assert first.json()["replica"] == second.json()["replica"]  # one prefix, one replica
    assert sum(len(replica.index) for replica in router.replicas) > 0
