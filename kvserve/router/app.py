"""The router's HTTP app: OpenAI-compatible endpoints proxied to kvserve replicas chosen by a routing policy.

A request's prompt text is keyed (``prefix_index``), the policy picks a healthy replica, and the request is
forwarded as it came; the answer streams back through as the replica writes it (no buffering), and a client
that disconnects closes the upstream stream, which the replica treats as an abort. A replica that refuses the
connection has not started the request: it is marked down and the request goes to another one. When none is
up the answer is a 503 with ``Retry-After``. A background task checks each replica's /health and reads its
queue from /metrics every ``health_interval`` seconds; a replica that comes back is used again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.policy import Decision, Replica, RoutingPolicy
from kvserve.router.prefix_index import prefix_keys
from kvserve.server.errors import error_response

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
QUEUE_METRICS = ("kvserve:num_requests_running", "kvserve:num_requests_waiting")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvserve_router:requests", "Requests sent to each replica.", ["replica"],
                                registry=self.registry)
        self.prefix_hits = Counter("kvserve_router:prefix_hit_chunks", "Prompt chunks the chosen replica had "
                                   "been sent before (64 characters each).", ["replica"], registry=self.registry)
        self.decisions = Counter("kvserve_router:decisions", "Routing decisions by reason.", ["reason"],
                                 registry=self.registry)
        self.retries = Counter("kvserve_router:retries", "Requests sent again after a replica refused them.",
                               registry=self.registry)
        self.healthy = Gauge("kvserve_router:replica_healthy", "1 while the replica answers /health.", ["replica"],
                             registry=self.registry)


def prompt_text(payload: dict[str, Any]) -> str:
    """The text a request's KV prefix comes from: the completion prompt, or the chat messages in order."""
    if "messages" in payload and isinstance(payload["messages"], list):
        return "\n".join(f"{m.get('role')}:{_content_text(m.get('content'))}" for m in payload["messages"]
                         if isinstance(m, dict))
    prompt = payload.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def request_payload(body: bytes) -> dict[str, Any] | Response:
    """The JSON object a generation request carries, or the 400 that says why the body is none."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return error_response(400, f"the request body is not valid JSON: {error}")
    if not isinstance(payload, dict):
        return error_response(400, "the request body must be a JSON object")
    return payload


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


class Router:
    """The replicas, the policy and the upstream client; ``forward`` sends one request through."""

    def __init__(self, urls: list[str], policy: RoutingPolicy, client: httpx.AsyncClient | None = None,
                 health_interval: float = 1.0) -> None:
        if not urls:
            raise ValueError("the router needs at least one replica URL")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.policy = policy
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.health_interval = health_interval
        self.metrics = RouterMetrics()

    def move(self, old_url: str, new_url: str) -> None:
        """A replica now answers at ``new_url`` (Ray restarted it elsewhere): a fresh entry, since the prompts
        sent to the old one are not cached at the new one."""
        for i, replica in enumerate(self.replicas):
            if replica.url == old_url.rstrip("/"):
                self.replicas[i] = Replica(new_url.rstrip("/"), healthy=False)  # until its health check
                return
        raise ValueError(f"no replica at {old_url}")

    async def forward(self, path: str, body: bytes, payload: dict[str, Any], headers: dict[str, str]) -> Response:
        keys = prefix_keys(prompt_text(payload))
        tried: set[Replica] = set()
        while True:
            candidates = [r for r in self.replicas if r.healthy and r not in tried]
            if not candidates:
                return error_response(503, "no kvserve replica is available; try again shortly",
                                      headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            decision = self.policy.choose(candidates, keys)
            replica = decision.replica
            # Counted before the send, which waits for the replica's headers: requests arriving meanwhile must
            # see this one's load and prefix, or a burst all goes where the first one went.
            replica.index.insert(keys)
            replica.in_flight += 1
            request = self.client.build_request("POST", replica.url + path, content=body, headers=headers)
            try:
                upstream = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:  # not started there: try another one
                replica.in_flight -= 1
                logger.warning("replica %s refused a request (%s); marking it down", replica.url, error)
                self._set_health(replica, False)
                tried.add(replica)
                self.metrics.retries.inc()
                continue
            except httpx.TransportError as error:  # sent, perhaps started, and the replica went away
                replica.in_flight -= 1
                self._set_health(replica, False)
                return error_response(502, f"the replica serving this request failed: {error!r}")
            self._count(decision)
            return await self._respond(replica, upstream)

    def _count(self, decision: Decision) -> None:
        replica = decision.replica
        self.metrics.requests.labels(replica.url).inc()
        self.metrics.prefix_hits.labels(replica.url).inc(decision.matched_chunks)
        self.metrics.decisions.labels(decision.reason).inc()

    async def _respond(self, replica: Replica, upstream: httpx.Response) -> Response:
        content_type = upstream.headers.get("content-type", "application/json")
        if content_type.startswith("text/event-stream"):
            return StreamingResponse(self._relay(replica, upstream), status_code=upstream.status_code,
                                     media_type=content_type)
        try:
            content = await upstream.aread()
        except httpx.TransportError as error:  # the replica died with the request in flight
            return error_response(502, f"the replica serving this request failed: {error}")
        finally:
            await self._release(replica, upstream)
        return Response(content, status_code=upstream.status_code, media_type=content_type)

    async def _relay(self, replica: Replica, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """The replica's stream as it comes; leaving early (a client disconnect) closes it, which aborts."""
        try:
            async for chunk in upstream.aiter_bytes():
                yield chunk
        except httpx.TransportError as error:
            logger.warning("replica %s broke off a stream: %s", replica.url, error)
        finally:
            await self._release(replica, upstream)

    async def _release(self, replica: Replica, upstream: httpx.Response) -> None:
        replica.in_flight -= 1
        await upstream.aclose()

    async def first_healthy_get(self, path: str) -> Response:
        for replica in self.replicas:
            if replica.healthy:
                with contextlib.suppress(httpx.TransportError):
                    answer = await self.client.get(replica.url + path)
                    return Response(answer.content, answer.status_code,
                                    media_type=answer.headers.get("content-type"))
        return error_response(503, "no kvserve replica is available", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    # ---- health ------------------------------------------------------------------------------------------

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(replica) for replica in self.replicas))

    async def _check(self, replica: Replica) -> None:
        try:
            healthy = (await self.client.get(replica.url + "/health", timeout=2.0)).status_code == 200
            if healthy:
                replica.reported_load = _queue_length((await self.client.get(replica.url + "/metrics")).text)
        except httpx.TransportError:
            healthy = False
        if healthy != replica.healthy:
            logger.warning("replica %s is %s", replica.url, "back up" if healthy else "down")
        self._set_health(replica, healthy)

    def _set_health(self, replica: Replica, healthy: bool) -> None:
        replica.healthy = healthy
        self.metrics.healthy.labels(replica.url).set(1 if healthy else 0)

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval)


def _queue_length(metrics_text: str) -> int:
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name in QUEUE_METRICS:
            total += sum(sample.value for sample in family.samples)
    return int(total)


def build_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.check_health()
        checker = asyncio.create_task(router.health_loop())
        yield
        checker.cancel()
        await router.client.aclose()

    app = FastAPI(title="kvserve router", lifespan=lifespan)

    async def proxy(request: Request, path: str) -> Response:
        body = await request.body()
        payload = request_payload(body)
        if isinstance(payload, Response):
            return payload
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        return await router.forward(path, body, payload, headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.first_healthy_get("/v1/models")

    @app.get("/health")
    async def health() -> Response:
        up = [r.url for r in router.replicas if r.healthy]
        status = 200 if up else 503
        return JSONResponse({"status": "ok" if up else "unavailable", "replicas_up": up}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
