"""The router's ASGI app: OpenAI-compatible endpoints proxied to kvserve replicas chosen by a routing policy.

A request's body is parsed once for its prompt text, which is keyed (``prefix_index``); the policy picks a
healthy replica, and the body is forwarded as the bytes it came as (``upstream``, over kept-alive
connections). The answer streams back through as the replica writes it (no buffering), and a client that
disconnects closes the upstream connection, which the replica treats as an abort. A replica that refuses the
connection has not started the request: it is marked down and the request goes to another one. When none is
up the answer is a 503 with ``Retry-After``. A background task checks each replica's /health and reads its
queue from /metrics every ``health_interval`` seconds; a replica that comes back is used again.

A body over ``max_body_bytes`` (the replicas' 4 MiB by default) is refused with the replicas' 413 before the
router holds more of it than that. A replica that sends nothing for the upstream's ``response_timeout`` (600 s
by default) is given up on and its connection closed (its abort): the client gets a 504, or a stream already
under way ends with an error event; the replica is left to the health checks (it may only be slow).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Awaitable, Callable
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import JSONResponse, Response

from kvserve.router.policy import Decision, Replica, RoutingPolicy
from kvserve.router.prefix_index import prefix_keys
from kvserve.router.upstream import ConnectFailed, Origin, Upstream, UpstreamLost, UpstreamResponse, UpstreamTimeout
from kvserve.server.errors import RETRY_LATER, error_response, shortened, sse_failure, unauthorized
from kvserve.server.sockets import BODY_SECONDS
from kvserve.server.state import DEFAULT_MAX_BODY_BYTES

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
GET_TIMEOUT_S = 30.0
# any replica answers /tokenize and /detokenize alike (one model): sent as a generation is, its prefix and all
PROXIED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})
PROTECTED_PATHS = PROXIED_PATHS | {"/v1/models"}  # with --api-key, as the replicas' (/health, /metrics stay open)
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
_FORWARDED = frozenset(name.encode() for name in FORWARDED_HEADERS)  # ASGI header names: lower-case bytes
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
    """The replicas, the policy and the upstream connections; ``proxy`` sends one request through."""

    def __init__(self, urls: list[str], policy: RoutingPolicy, upstream: Upstream | None = None,
                 health_interval: float = 1.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 api_key: str | None = None) -> None:
        if not urls:
            raise ValueError("the router needs at least one replica URL")
        if max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {max_body_bytes}")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        for replica in self.replicas:
            _target(replica.url)  # a malformed URL fails here, not on the first request
        self.policy = policy
        self.upstream = upstream or Upstream()
        self.health_interval = health_interval
        self.max_body_bytes = max_body_bytes  # the replicas' limit by default: a larger body would get their 413
        self.api_key = api_key  # checked before a body is read: a client without it costs the router nothing
        self.metrics = RouterMetrics()

    def move(self, old_url: str, new_url: str) -> None:
        """A replica now answers at ``new_url`` (Ray restarted it elsewhere): a fresh entry, since the prompts
        sent to the old one are not cached at the new one."""
        for i, replica in enumerate(self.replicas):
            if replica.url == old_url.rstrip("/"):
                self.replicas[i] = Replica(new_url.rstrip("/"), healthy=False)  # until its health check
                return
        raise ValueError(f"no replica at {old_url}")

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One generation request, from ASGI messages to ASGI messages: the body parsed once (for the prompt)
        and forwarded as it came, the answer relayed as the replica writes it."""
        body = await _read_body(scope, receive, self.max_body_bytes)
        if body is None:  # the client left before its request was in
            return
        if isinstance(body, Response):
            return await body(scope, receive, send)
        payload = request_payload(body)
        if isinstance(payload, Response):
            return await payload(scope, receive, send)
        headers = [(name, value) for name, value in scope["headers"] if name in _FORWARDED]
        answer = await self.forward(scope["path"], body, payload, headers)
        if isinstance(answer, Response):
            return await answer(scope, receive, send)
        replica, upstream = answer
        try:
            await self._relay(scope, receive, send, replica, upstream)
        finally:
            replica.in_flight -= 1
            upstream.close()  # nothing if it was read to its end (the connection is back in the pool)

    async def forward(self, path: str, body: bytes, payload: dict[str, Any],
                      headers: list[tuple[bytes, bytes]]) -> tuple[Replica, UpstreamResponse] | Response:
        """Choose a replica and send the request there, retrying another replica while one refuses it or answers
        503; the replica (its ``in_flight`` counted) and the head of its answer, or the error to answer with."""
        keys = prefix_keys(prompt_text(payload))
        tried: set[Replica] = set()
        while True:
            candidates = [r for r in self.replicas if r.healthy and r not in tried]
            if not candidates:
                return error_response(503, "no kvserve replica is available; try again shortly",
                                      headers=RETRY_LATER)
            decision = self.policy.choose(candidates, keys)
            replica = decision.replica
            # Counted before the send, which waits for the replica's headers: requests arriving meanwhile must
            # see this one's load and prefix, or a burst all goes where the first one went.
            replica.index.insert(keys)
            replica.in_flight += 1
            handed_over = False  # to the caller, which uncounts it once the answer is relayed
            try:
                upstream = await self._send(replica, path, body, headers)
                if isinstance(upstream, UpstreamResponse) and not (
                        upstream.status == HTTPStatus.SERVICE_UNAVAILABLE and len(candidates) > 1):
                    self._count(decision)
                    handed_over = True
                    return replica, upstream
            finally:
                if not handed_over:
                    replica.in_flight -= 1
            if isinstance(upstream, Response):
                return upstream
            # refused (not started there), or a 503 (loading, draining, overloaded or failed there: nothing
            # started) with another replica left to try; the health checks decide whether this one is down
            if upstream is not None:
                upstream.close()
            tried.add(replica)
            self.metrics.retries.inc()

    async def _send(self, replica: Replica, path: str, body: bytes,
                    headers: list[tuple[bytes, bytes]]) -> UpstreamResponse | Response | None:
        """The head of ``replica``'s answer; None if it refused the connection (it is marked down); the error
        to answer with if it was lost (marked down) or silent (left to the health checks: it may only be slow)
        after the request went out."""
        origin, base_path = _target(replica.url)
        try:
            return await self.upstream.request(b"POST", origin, base_path + path.encode(), body, headers)
        except ConnectFailed as error:
            logger.warning("replica %s refused a request (%s); marking it down", replica.url, error)
            self._set_health(replica, False)
            return None
        except UpstreamLost as error:  # sent, perhaps started, and the replica went away or went silent
            if not isinstance(error, UpstreamTimeout):
                self._set_health(replica, False)
            return _failure_response(error)

    def _count(self, decision: Decision) -> None:
        replica = decision.replica
        self.metrics.requests.labels(replica.url).inc()
        self.metrics.prefix_hits.labels(replica.url).inc(decision.matched_chunks)
        self.metrics.decisions.labels(decision.reason).inc()

    async def _relay(self, scope: Scope, receive: Receive, send: Send, replica: Replica,
                     upstream: UpstreamResponse) -> None:
        """The replica's answer: a stream chunk by chunk as it arrives, anything else whole (so that a replica
        lost mid-answer is a 502, not a cut 200). A client that leaves closes the upstream connection, which
        the replica takes as an abort."""
        left = asyncio.ensure_future(receive())  # http.disconnect: the client left, or the answer is over
        left.add_done_callback(lambda _: upstream.close())
        content_type = upstream.headers.get("content-type", "application/json")
        start = {"type": "http.response.start", "status": upstream.status,
                 "headers": [(b"content-type", content_type.encode("latin-1"))]}
        if not content_type.startswith("text/event-stream"):
            try:
                content = await upstream.read()
            except UpstreamLost as error:  # the replica died (or went silent) with the request in flight
                return await _failure_response(error)(scope, receive, send)
            start["headers"].append((b"content-length", b"%d" % len(content)))
            await send(start)
            return await send({"type": "http.response.body", "body": content})
        await send(start)
        try:
            while chunk := await upstream.receive():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamLost as error:
            logger.warning("replica %s broke off a stream: %s", replica.url, error)
            if not isinstance(error, UpstreamTimeout):  # a silent one is left to the health checks
                self._set_health(replica, False)
            failure = sse_failure(*_failure(error))
            await send({"type": "http.response.body", "body": failure.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def first_healthy_get(self, path: str, headers: list[tuple[bytes, bytes]] | tuple = ()) -> Response:
        """The first healthy replica's answer to a GET of ``path``, sent with ``headers`` (the client's key)."""
        for replica in self.replicas:
            if replica.healthy:
                with contextlib.suppress(ConnectFailed, UpstreamLost):
                    status, content_type, content = await self.upstream.get(replica.url + path, GET_TIMEOUT_S,
                                                                            headers)
                    return Response(content, status, media_type=content_type or None)
        return error_response(503, "no kvserve replica is available", headers=RETRY_LATER)

    # ---- health ------------------------------------------------------------------------------------------

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(replica) for replica in self.replicas))
        self.upstream.prune()

    async def _check(self, replica: Replica) -> None:
        try:
            healthy = (await self.upstream.get(replica.url + "/health", HEALTH_TIMEOUT_S))[0] == 200
            if healthy:
                metrics = (await self.upstream.get(replica.url + "/metrics", GET_TIMEOUT_S))[2]
                replica.reported_load = _queue_length(metrics.decode())
        except (ConnectFailed, UpstreamLost):
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


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[Origin, bytes]:
    """A replica's origin, and the path its routes sit under (usually none)."""
    return Origin.parse(url), urlsplit(url).path.rstrip("/").encode()


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes | Response | None:
    """The request body; the replicas' 413 for one over ``limit`` bytes, as soon as its declared length or what
    has come of it is over (the rest is not read); None if the client disconnected before all of it came."""
    declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return _too_large(limit)
    parts, size = [], 0
    try:
        async with asyncio.timeout(BODY_SECONDS):  # the replicas' deadline: a body a byte at a time held it forever
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > limit:
                    return _too_large(limit)
                if not message.get("more_body", False):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
    except TimeoutError:
        return error_response(408, f"the request body did not come whole within {BODY_SECONDS:g} s")


def _too_large(limit: int) -> Response:
    return error_response(413, f"the request body is over the limit of {limit} bytes")  # the replicas' words


def _failure(error: UpstreamLost) -> tuple[int, str]:
    """The status and message for a replica lost (502) or silent (504) with a request in flight."""
    if isinstance(error, UpstreamTimeout):
        return 504, f"the replica serving this request stopped answering: {error}"
    return 502, f"the replica serving this request failed: {error}"


def _failure_response(error: UpstreamLost) -> Response:
    return error_response(*_failure(error))


def _queue_length(metrics_text: str) -> int:
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name in QUEUE_METRICS:
            total += sum(sample.value for sample in family.samples)
    return int(total)


class RouterApp:
    """The router's ASGI app. The generation routes go to ``Router.proxy`` as plain ASGI messages (no Starlette
    request, response or task group on the path every token takes); ``/health``, ``/metrics`` and
    ``/v1/models`` answer from here; the lifespan runs the health checks. No FastAPI: the router starts in
    well under a second."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.get_routes: dict[str, Callable[[Scope], Awaitable[Response]]] = {
            "/health": self.health, "/metrics": self.metrics, "/v1/models": self.models}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        key = self.router.api_key
        refused = unauthorized(scope["headers"], key) if key is not None and path in PROTECTED_PATHS else None
        if refused is not None:
            return await error_response(refused.status, refused.message)(scope, receive, send)
        if path in PROXIED_PATHS and method == "POST":
            return await self.router.proxy(scope, receive, send)
        if path in PROXIED_PATHS or (path in self.get_routes and method not in ("GET", "HEAD")):
            response = error_response(405, f"{method} is not allowed on {path}",
                                      headers={"Allow": "POST" if path in PROXIED_PATHS else "GET"})
        elif path in self.get_routes:
            response = await self.get_routes[path](scope)
        else:
            response = error_response(404, f"no route {shortened(path)}")
        await response(scope, receive, send)

    async def health(self, scope: Scope) -> Response:
        up = [r.url for r in self.router.replicas if r.healthy]
        status = 200 if up else 503
        return JSONResponse({"status": "ok" if up else "unavailable", "replicas_up": up}, status_code=status)

    async def metrics(self, scope: Scope) -> Response:
        return Response(generate_latest(self.router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, scope: Scope) -> Response:
        """A replica's list, asked with the client's key (replicas started with --api-key want it)."""
        key = [(name, value) for name, value in scope["headers"] if name == b"authorization"]
        return await self.router.first_healthy_get("/v1/models", key)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        """Startup: one round of health checks, then the loop in the background; shutdown: stop it, close the
        connections."""
        await receive()  # lifespan.startup
        await self.router.check_health()
        checker = asyncio.create_task(self.router.health_loop())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        checker.cancel()
        await self.router.upstream.aclose()
        await send({"type": "lifespan.shutdown.complete"})


def build_router_app(router: Router) -> RouterApp:
    return RouterApp(router)
