"""The router's app against fake replicas (an httpx mock transport): forwarding as sent, streams relayed,
retries where a replica refused, 503 when none is up, health and metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.router.app import Router, build_router_app, prompt_text
from kvserve.router.policy import make_policy
from kvserve.router.prefix_index import CHUNK_CHARS

LONG = "x" * CHUNK_CHARS * 3


class FakeReplicas:
    """Replica r0, r1...: /health 200 unless down, /metrics with a queue, completions echo who answered."""

    def __init__(self, count: int) -> None:
        self.down: set[str] = set()
        self.seen: list[tuple[str, dict]] = []
        self.urls = [f"http://r{i}" for i in range(count)]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}"
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/metrics":
            return httpx.Response(200, text='kvserve:num_requests_waiting{model_name="m"} 0.0\n')
        payload = json.loads(request.content)
        self.seen.append((host, payload))
        if payload.get("stream"):
            body = b"".join(f"data: {json.dumps({'replica': host, 'i': i})}\n\n".encode() for i in range(3))
            return httpx.Response(200, content=body + b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"replica": host, "auth": request.headers.get("authorization")})


def router_client(fakes: FakeReplicas, policy: str = "cache_aware") -> tuple[Router, httpx.AsyncClient]:
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(fakes))
    router = Router(fakes.urls, make_policy(policy), client=upstream)
    app = build_router_app(router)
    return router, httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router")


def run(coroutine):
    return asyncio.run(coroutine)


def test_requests_with_one_prefix_land_on_one_replica() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> list[str]:
        router, client = router_client(fakes)
        await router.check_health()
        answers = []
        for suffix in "abcd":
            reply = await client.post("/v1/completions", json={"prompt": LONG + suffix, "max_tokens": 1},
                                      headers={"Authorization": "Bearer k"})
            answers.append(reply.json())
        return answers

    answers = run(scenario())
    assert len({a["replica"] for a in answers}) == 1 and all(a["auth"] == "Bearer k" for a in answers)
    assert [payload["prompt"][-1] for _, payload in fakes.seen] == list("abcd")  # forwarded as sent


def test_round_robin_spreads_them() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> None:
        router, client = router_client(fakes, "round_robin")
        for suffix in "abcd":
            await client.post("/v1/completions", json={"prompt": LONG + suffix})

    run(scenario())
    assert [host for host, _ in fakes.seen] == ["http://r0", "http://r1"] * 2


def test_a_stream_is_relayed_as_the_replica_wrote_it() -> None:
    fakes = FakeReplicas(1)

    async def scenario() -> tuple[str, str]:
        router, client = router_client(fakes)
        reply = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "stream": True})
        return reply.headers["content-type"], reply.text

    content_type, text = run(scenario())
    assert content_type.startswith("text/event-stream")
    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")


def test_a_refusing_replica_is_marked_down_and_the_request_served_elsewhere() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> tuple[dict, Router]:
        router, client = router_client(fakes)
        router.replicas[1].in_flight = 5  # r0 is the least loaded: the first choice
        fakes.down.add("http://r0")
        reply = await client.post("/v1/completions", json={"prompt": "p"})
        return reply.json(), router

    answer, router = run(scenario())
    assert answer["replica"] == "http://r1" and not router.replicas[0].healthy
    assert router.metrics.retries._value.get() == 1


def test_no_replica_up_is_a_503_with_retry_after_and_the_router_stays_up() -> None:
    fakes = FakeReplicas(2)
    fakes.down.update(fakes.urls)

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        router, client = router_client(fakes)
        await router.check_health()
        refused = await client.post("/v1/completions", json={"prompt": "p"})
        health = await client.get("/health")
        fakes.down.clear()
        await router.check_health()  # the replicas are back: used again
        return refused, health, await client.post("/v1/completions", json={"prompt": "p"})

    refused, health, again = run(scenario())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == 503 and health.status_code == 503
    assert again.status_code == 200


def test_a_body_that_is_not_json_is_a_400() -> None:
    async def scenario() -> httpx.Response:
        _, client = router_client(FakeReplicas(1))
        return await client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})

    reply = run(scenario())
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]


def test_metrics_count_requests_and_prefix_hits_per_replica() -> None:
    fakes = FakeReplicas(2)

    async def scenario() -> str:
        router, client = router_client(fakes)
        for _ in range(3):
            await client.post("/v1/completions", json={"prompt": LONG})
        return (await client.get("/metrics")).text

    text = run(scenario())
    assert 'kvserve_router:requests_total{replica="http://r0"} 3.0' in text
    assert 'kvserve_router:prefix_hit_chunks_total{replica="http://r0"} 6.0' in text  # 3 chunks, twice
    assert 'kvserve_router:decisions_total{reason="prefix"} 2.0' in text


@pytest.mark.parametrize("payload, text", [
    ({"prompt": "abc"}, "abc"),
    ({"prompt": [1, 2]}, "[1, 2]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "user:hi"),
])
def test_prompt_text(payload: dict, text: str) -> None:
    assert prompt_text(payload) == text


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

    async def slow_replicas(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            arrived.append(f"http://{request.url.host}")
            if len(arrived) == num_requests:
                all_arrived.set()
            await all_arrived.wait()
        return fakes(request)

    async def scenario() -> None:
        router = Router(fakes.urls, make_policy("cache_aware"),
                        client=httpx.AsyncClient(transport=httpx.MockTransport(slow_replicas)))
        client = httpx.AsyncClient(transport=httpx.ASGITransport(build_router_app(router)), base_url="http://router")
        body = {"model": "m", "prompt": LONG}
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(num_requests)))
        assert all(answer.status_code == 200 for answer in answers)

    run(scenario())
    counts = {url: arrived.count(url) for url in fakes.urls}
    assert counts["http://r0"] == 9 + 1 and counts["http://r1"] == 10, counts  # r0 by prefix until 9 ahead, then the two alternate
