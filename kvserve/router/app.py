"""The router's ASGI app: OpenAI-compatible endpoints proxied to kvserve replicas chosen by a routing policy.

A request's body is parsed once for its prompt text (``prompts``), which is keyed (``prefix_index``); the
policy picks a healthy replica, and the body is forwarded as the bytes it came as (``upstream``, over kept-alive
connections; a body that is no JSON object is forwarded too, for the replica to refuse in its words). The
answer streams back through as the replica writes it (no buffering), with the replica's headers but the
hop-by-hop ones. A client that disconnects, from the moment its request is forwarded (a non-streamed answer's
head comes only once its generation is done), closes the upstream connection, which the replica treats as an
abort. A replica that refuses the connection has not started the request: it is marked down and the request
goes to another one. When none is up the answer is a 503 with ``Retry-After``. The lifespan runs the health
checks (``health``: each replica's /health, and its /metrics, read for its queue and shown on the router's own,
``metrics``) every ``health_interval`` seconds; a replica that comes back is used again.

A body over ``max_body_bytes`` (the replicas' 4 MiB by default) is refused with the replicas' 413 before the
router holds more of it than that. A replica that sends nothing for the upstream's ``response_timeout`` (600 s
by default) is given up on and its connection closed (its abort): the client gets a 504, or a stream already
under way ends with an error event; the replica is left to the health checks (it may only be slow).

LoRA loads and unloads go to every replica (``update_adapters``); the loads all took are remembered
(``runtime_adapters``) and replayed to a replica that comes (back) up, before it is routed to
(``replay_adapters``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Sequence, TypeVar
from urllib.parse import quote, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import URL
from starlette.responses import JSONResponse, RedirectResponse, Response

from kvserve import __version__
from kvserve.router.health import GET_TIMEOUT_S, HealthChecker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policy import Replica, RoutingPolicy
from kvserve.router.prefix_index import PrefixIndex, prefix_keys
from kvserve.router.prompts import EMBEDDING_PATHS, SCORE_PATHS, request_payload, request_text
from kvserve.router.runtime_adapters import RuntimeAdapters
from kvserve.router.upstream import ConnectFailed, Origin, Upstream, UpstreamLost, UpstreamResponse, UpstreamTimeout
from kvserve.server.environment import check_api_keys
from kvserve.server.errors import (
    PROTECTED_PREFIXES,
    RETRY_LATER,
    APIError,
    error_response,
    no_route,
    sse_failure,
    unauthorized,
    wrong_method,
)
from kvserve.server.request_body import read_body
from kvserve.server.request_ids import echoing_request_id
from kvserve.server.state import DEFAULT_MAX_BODY_BYTES

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

# the requests that leave KV behind: generations, and the pooling endpoints' prompts (embedded in the same KV pool);
# SageMaker's /invocations, one of those bodies, keyed as they are
CACHING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                           *EMBEDDING_PATHS, *SCORE_PATHS, "/invocations"})
# any replica answers /tokenize and /detokenize alike (one model): sent as a generation is, its prefix and all
PROXIED_PATHS = CACHING_PATHS | {"/tokenize", "/detokenize", "/v1/messages/count_tokens"}
PING_PATH = "/ping"  # SageMaker's health check, GET or POST: the router's /health
MODEL_PATH = "/v1/models/"  # + a model's name: its card, which any replica answers
# runtime LoRA updates: sent to every replica, so that each serves the same adapters (``Router.update_adapters``)
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
ADAPTER_PATHS = frozenset({LOAD_ADAPTER_PATH, "/v1/unload_lora_adapter"})
# a replica's development endpoint that empties its prefix cache: sent to every replica (``Router.reset_prefix_caches``)
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
POSTED_PATHS = PROXIED_PATHS | ADAPTER_PATHS | {RESET_PREFIX_CACHE_PATH}
# The client's headers a replica gets: its key and formats, and what names the request to proxies and tracing in
# between (kvserve's replicas do not read those yet); the rest are the client's business, or hop-by-hop
FORWARDED_HEADERS = ("authorization", "x-api-key", "content-type", "accept", "x-request-id", "traceparent",
                     "tracestate")
_FORWARDED = frozenset(name.encode() for name in FORWARDED_HEADERS)  # ASGI header names: lower-case bytes
# A replica's headers the client does not get: hop-by-hop ones (RFC 9110 section 7.6.1, and any that `connection`
# names), and those the router's own server and CORS layer write (content-length: the router frames the body anew;
# vary: its CORS layer, the replicas' policy, adds Origin to a relayed one, which said "Origin, Origin")
UNRELAYED_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                               "upgrade", "proxy-authenticate", "proxy-authorization", "content-length", "date",
                               "server", "vary"})
T = TypeVar("T")


def forwarded_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's request headers that go on to the replica (``FORWARDED_HEADERS``)."""
    return [(name, value) for name, value in headers if name in _FORWARDED]


def relayed_headers(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """A replica's response headers (lower-case names) as the client gets them: all but ``UNRELAYED_HEADERS`` and
    those the replica's ``connection`` header names (hop-by-hop too)."""
    named = {token.strip() for name, value in headers if name == "connection" for token in value.lower().split(",")}
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers
            if name not in UNRELAYED_HEADERS and name not in named]


class Router:
    """The replicas, the policy, the upstream connections, the metrics and the health checks; ``proxy`` sends one
    request through."""

    def __init__(self, urls: list[str], policy: RoutingPolicy, upstream: Upstream | None = None,
                 health_interval: float = 1.0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 api_keys: Sequence[str] = ()) -> None:
        if not urls:
            raise ValueError("the router needs at least one replica URL")
        if max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {max_body_bytes}")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        for replica in self.replicas:
            _target(replica.url)  # a malformed URL fails here, not on the first request
        self.policy = policy
        self.upstream = upstream or Upstream()
        self.max_body_bytes = max_body_bytes  # the replicas' limit by default: a larger body would get their 413
        check_api_keys(api_keys)
        self.api_keys = tuple(api_keys)  # checked before a body is read: a client without one costs the router nothing
        self.metrics = RouterMetrics()
        self.health = HealthChecker(self.replicas, self.upstream, self.metrics, health_interval,
                                    on_up=self.replay_adapters)
        self._updating_adapters = asyncio.Lock()  # LoRA loads and unloads, one at a time (``update_adapters``)
        self.adapters = RuntimeAdapters()  # the loads every replica took, for a replica that comes back
        self._replay_failures: dict[str, str] = {}  # replica -> its last replay's failure (logged once)

    def move(self, old_url: str, new_url: str) -> None:
        """A replica now answers at ``new_url`` (Ray restarted it elsewhere): a fresh entry, since the prompts
        sent to the old one are not cached at the new one."""
        for i, replica in enumerate(self.replicas):
            if replica.url == old_url.rstrip("/"):
                self.replicas[i] = Replica(new_url.rstrip("/"), healthy=False)  # until its health check
                self.metrics.replica_pages.pages.pop(replica.url, None)
                return
        raise ValueError(f"no replica at {old_url}")

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One generation request, from ASGI messages to ASGI messages: the body parsed once (for the prompt)
        and forwarded as it came, the answer relayed as the replica writes it. The client is watched from the
        moment its body is in: one that leaves before the head of the answer (all of a non-streamed
        generation's time) or during its body closes the upstream connection, the replica's abort."""
        try:
            body = await read_body(scope, receive, self.max_body_bytes)
        except APIError as e:  # the replicas' answer, before the body was all read: its headers close the connection
            return await error_response(e.status, e.message, e.param, e.headers, scope["path"])(scope, receive, send)
        if body is None:  # the client left before its request was in
            return
        left = asyncio.ensure_future(receive())  # http.disconnect: the client left, or its answer is over
        try:
            forwarding = self.forward(scope["path"], body, request_payload(body), forwarded_headers(scope["headers"]))
            answer = await _unless_done(left, forwarding)
            if answer is None:  # the client left: the request was cancelled, its connection closed
                return
            if isinstance(answer, Response):
                return await answer(scope, receive, send)
            replica, upstream = answer
            try:
                await self._relay(scope, receive, send, replica, upstream, left)
            finally:
                replica.in_flight -= 1
                upstream.close()  # nothing if it was read to its end (the connection is back in the pool)
        finally:
            left.cancel()

    async def forward(self, path: str, body: bytes, payload: dict[str, Any],
                      headers: list[tuple[bytes, bytes]]) -> tuple[Replica, UpstreamResponse] | Response:
        """Choose a replica and send the request there, retrying another replica while one refuses it or answers
        503; the replica (its ``in_flight`` counted) and the head of its answer, or the error to answer with."""
        keys = prefix_keys(request_text(path, payload))
        tried: set[Replica] = set()
        while True:
            candidates = [r for r in self.replicas if r.healthy and r not in tried]
            if not candidates:
                return error_response(503, "no kvserve replica is available; try again shortly",
                                      headers=RETRY_LATER, path=path)
            decision = self.policy.choose(candidates, keys)
            replica = decision.replica
            # Counted before the send, which waits for the replica's headers: requests arriving meanwhile must
            # see this one's load and prefix, or a burst all goes where the first one went.
            # (a /tokenize computes no KV: it goes where its prefix is, but leaves no keys)
            insertion = replica.index.insert(keys if path in CACHING_PATHS else [])
            replica.in_flight += 1
            handed_over = False  # to the caller, which uncounts it once the answer is relayed
            try:
                upstream = await self._send(replica, path, body, headers)
                if _turned_down(upstream):  # the replica cached none of it: its keys would only crowd others out
                    replica.index.forget(insertion)
                if isinstance(upstream, UpstreamResponse) and not (
                        upstream.status == HTTPStatus.SERVICE_UNAVAILABLE and len(candidates) > 1):
                    self.metrics.count(decision)
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
            self.health.mark_down(replica)
            return None
        except UpstreamLost as error:  # sent, perhaps started, and the replica went away or went silent
            if not isinstance(error, UpstreamTimeout):
                self.health.mark_down(replica)
            return _failure_response(error, path)

    async def update_adapters(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A LoRA adapter loaded or unloaded on every replica, healthy or not, at once: the first replica's answer
        where all succeed, else the first failure's status with its message, naming the replica. A load that
        failed anywhere is unloaded where it succeeded, so that every replica serves the same adapters. One update
        at a time: two sent together reach each replica in one order (else a slow replica could take an unload
        before the load it follows, and serve the adapter alone)."""
        path = scope["path"]
        try:
            body = await read_body(scope, receive, self.max_body_bytes)
        except APIError as e:
            return await error_response(e.status, e.message, e.param, e.headers, path)(scope, receive, send)
        if body is None:  # the client left before its request was in
            return
        async with self._updating_adapters:
            response = await self._update_every_replica(path, body, forwarded_headers(scope["headers"]))
        await response(scope, receive, send)

    async def _update_every_replica(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> Response:
        replicas = list(self.replicas)
        answers = await asyncio.gather(*(self._post(replica, path, body, headers) for replica in replicas))
        failures = [(replica, answer) for replica, answer in zip(replicas, answers) if answer[0] != HTTPStatus.OK]
        done = [replica for replica, answer in zip(replicas, answers) if answer[0] == HTTPStatus.OK]
        if path == LOAD_ADAPTER_PATH and not failures:
            self.adapters.remember(body, headers)
        elif path != LOAD_ADAPTER_PATH and done:  # unloaded somewhere: no longer served by every replica
            self.adapters.forget(body)
        if not failures:
            return _relayed(*answers[0])
        outcome = ""
        if done and path == LOAD_ADAPTER_PATH:
            unload = json.dumps({"lora_name": request_payload(body).get("lora_name")}).encode()
            await asyncio.gather(*(self._post(replica, "/v1/unload_lora_adapter", unload, headers) for replica in done))
            outcome = f" (unloaded again from {', '.join(replica.url for replica in done)})"
        elif done:
            outcome = f" (unloaded from {', '.join(replica.url for replica in done)})"
        replica, (status, _, content) = failures[0]
        message, param = _error_of(content)
        return error_response(status, f"replica {replica.url}: {message}{outcome}", param, path=path)

    async def reset_prefix_caches(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /reset_prefix_cache sent to every replica at once, its query string with it: the first replica's
        answer where every one emptied its cache, else the first other answer's status and message, naming the
        replica. The router's guess of a replica's cache (its ``PrefixIndex``) is emptied where the replica let go
        of what no request held (200, or 409: the blocks running requests hold stay, and are forgotten here
        too)."""
        path, query = scope["path"], scope["query_string"].decode("latin-1")
        replicas, headers = list(self.replicas), forwarded_headers(scope["headers"])
        target = f"{path}?{query}" if query else path
        answers = await asyncio.gather(*(self._post(replica, target, b"", headers) for replica in replicas))
        for replica, (status, _, _) in zip(replicas, answers):
            if status in (HTTPStatus.OK, HTTPStatus.CONFLICT):
                replica.index = PrefixIndex(replica.index.max_keys)
        failed = next(((replica, answer) for replica, answer in zip(replicas, answers) if answer[0] != HTTPStatus.OK),
                      None)
        if failed is None:
            response = _relayed(*answers[0])
        else:
            replica, (status, _, content) = failed
            message, param = _error_of(content)
            response = error_response(status, f"replica {replica.url}: {message}", param, path=path)
        await response(scope, receive, send)

    async def replay_adapters(self, replica: Replica) -> bool:
        """Whether ``replica``, found up after it was down, serves every adapter loaded through the router: those
        its /v1/models does not list (it restarted knowing only its ``--lora-modules``) are loaded there again, in
        load order. A replay that fails keeps the replica out of rotation entirely (logged; tried again at its next
        check): serving some adapters and not others, it would answer 404 for a request that names one."""
        async with self._updating_adapters:  # the remembered loads are those every replica took: none is under way
            loads = self.adapters.loads()
            if not loads:
                return True
            try:
                served = await self._served_models(replica, loads[-1].headers)
            except ValueError as error:
                return self._replay_failed(replica, f"its /v1/models does not read ({error})")
            for load in loads:
                if load.name in served:
                    continue
                status, _, content = await self._post(replica, LOAD_ADAPTER_PATH, load.body, load.headers)
                if status != HTTPStatus.OK:
                    message, _ = _error_of(content)
                    return self._replay_failed(replica, f"loading LoRA adapter {load.name!r} again failed ({status}: "
                                                        f"{message})")
                logger.info("replica %s: LoRA adapter %r loaded again", replica.url, load.name)
        if self._replay_failures.pop(replica.url, None) is not None:
            logger.info("replica %s: its LoRA adapters are loaded again", replica.url)
        return True

    async def _served_models(self, replica: Replica, headers: list[tuple[bytes, bytes]]) -> set[str]:
        """The model and adapter names ``replica`` lists; ValueError saying why where it cannot tell."""
        try:
            status, _, content = await self.upstream.get(replica.url + "/v1/models", GET_TIMEOUT_S, headers)
        except (ConnectFailed, UpstreamLost) as error:
            raise ValueError(f"not reachable: {error}") from error
        if status != HTTPStatus.OK:
            raise ValueError(f"status {status}: {_error_of(content)[0]}")
        try:
            return {str(model["id"]) for model in json.loads(content)["data"]}
        except (KeyError, TypeError) as error:
            raise ValueError(f"no model list: {error!r}") from error

    def _replay_failed(self, replica: Replica, reason: str) -> bool:
        """Log a replay's failure (once while it fails alike) and keep the replica out: False."""
        if self._replay_failures.get(replica.url) != reason:
            logger.error("replica %s is kept out of rotation: %s; retried at its next health check", replica.url,
                         reason)
        self._replay_failures[replica.url] = reason
        return False

    async def _post(self, replica: Replica, path: str, body: bytes,
                    headers: list[tuple[bytes, bytes]]) -> tuple[int, list[tuple[str, str]], bytes]:
        """A whole POST answer from ``replica`` (status, ``header_list``, body); a replica that cannot be reached
        is a 502 saying why."""
        origin, base_path = _target(replica.url)
        try:
            upstream = await self.upstream.request(b"POST", origin, base_path + path.encode(), body, headers)
            try:
                return upstream.status, upstream.header_list, await upstream.read()
            finally:
                upstream.close()
        except (ConnectFailed, UpstreamLost) as error:
            message = json.dumps({"error": {"message": f"not reachable: {error}"}}).encode()
            return HTTPStatus.BAD_GATEWAY, [], message

    async def _relay(self, scope: Scope, receive: Receive, send: Send, replica: Replica,
                     upstream: UpstreamResponse, left: asyncio.Future) -> None:
        """The replica's answer: a stream chunk by chunk as it arrives, anything else whole (so that a replica
        lost mid-answer is a 502, not a cut 200). A client that leaves (``left``) closes the upstream
        connection, which the replica takes as an abort."""
        left.add_done_callback(lambda _: upstream.close())
        start = {"type": "http.response.start", "status": upstream.status,
                 "headers": relayed_headers(upstream.header_list)}
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await upstream.read()
            except UpstreamLost as error:  # the replica died (or went silent) with the request in flight
                return await _failure_response(error, scope["path"])(scope, receive, send)
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
                self.health.mark_down(replica)
            failure = sse_failure(*_failure(error), scope["path"])
            await send({"type": "http.response.body", "body": failure.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def first_healthy_get(self, path: str, headers: list[tuple[bytes, bytes]]) -> Response:
        """The first healthy replica's answer to a GET of ``path``, sent with ``headers`` (the client's key)."""
        for replica in self.replicas:
            if replica.healthy:
                with contextlib.suppress(ConnectFailed, UpstreamLost):
                    status, response_headers, content = await self.upstream.get(replica.url + path, GET_TIMEOUT_S,
                                                                                headers)
                    response = Response(content, status)
                    response.raw_headers += relayed_headers(response_headers)
                    return response
        return error_response(503, "no kvserve replica is available", headers=RETRY_LATER)


async def _unless_done(done: asyncio.Future, work: Awaitable[T]) -> T | None:
    """What ``work`` comes to, or None if ``done`` is done first: ``work`` is then cancelled (a request being
    sent, or waiting for the head of its answer, closes its connection)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait((task, done), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


def _error_of(content: bytes) -> tuple[str, str | None]:
    """The message and param of a replica's error answer (its own text where it is not OpenAI's shape)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = json.loads(content)["error"]
        return str(error["message"]), error.get("param")
    return content.decode("utf-8", "replace")[:500], None


def _relayed(status: int, headers: list[tuple[str, str]], content: bytes) -> Response:
    """A replica's whole answer as the router's."""
    response = Response(content, status)
    response.raw_headers += relayed_headers(headers)
    return response


def _turned_down(upstream: UpstreamResponse | Response | None) -> bool:
    """Whether a replica turned the request down before running it: it refused the connection (None) or
    answered an error status (a 4xx for bad input, a 503 loading or overloaded)."""
    return upstream is None or isinstance(upstream, UpstreamResponse) and upstream.status >= 400


@functools.lru_cache(maxsize=1024)
def _target(url: str) -> tuple[Origin, bytes]:
    """A replica's origin, and the path its routes sit under (usually none)."""
    return Origin.parse(url), urlsplit(url).path.rstrip("/").encode()


def _failure(error: UpstreamLost) -> tuple[int, str]:
    """The status and message for a replica lost (502) or silent (504) with a request in flight."""
    if isinstance(error, UpstreamTimeout):
        return 504, f"the replica serving this request stopped answering: {error}"
    return 502, f"the replica serving this request failed: {error}"


def _failure_response(error: UpstreamLost, path: str) -> Response:
    return error_response(*_failure(error), path=path)


class RouterApp:
    """The router's ASGI app. The generation routes go to ``Router.proxy`` as plain ASGI messages (no Starlette
    request, response or task group on the path every token takes); ``/health``, ``/metrics``, ``/version``,
    ``/v1/models`` and ``/v1/models/{model}`` answer from here; the lifespan runs the health checks. No FastAPI:
    the router starts in well under a second. What it answers itself in a replica's place (404, 405, the redirect
    of a trailing slash) it answers as a replica does."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.get_routes: dict[str, Callable[[Scope], Awaitable[Response]]] = {
            "/health": self.health, PING_PATH: self.health, "/metrics": self.metrics, "/version": self.version,
            "/v1/models": self.models}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return
        send = echoing_request_id(scope, send)  # on the router's own answers; a replica's carries it already
        path, method = scope["path"], scope["method"]
        keys = self.router.api_keys
        refused = unauthorized(scope["headers"], keys) if keys and path.startswith(PROTECTED_PREFIXES) else None
        if refused is not None:  # before the body is read, as a replica's: its headers close the connection
            return await error_response(refused.status, refused.message, headers=refused.headers,
                                        path=path)(scope, receive, send)
        if path in PROXIED_PATHS and method == "POST":
            return await self.router.proxy(scope, receive, send)
        if path in ADAPTER_PATHS and method == "POST":
            return await self.router.update_adapters(scope, receive, send)
        if path == RESET_PREFIX_CACHE_PATH and method == "POST":
            return await self.router.reset_prefix_caches(scope, receive, send)
        if path == PING_PATH and method == "POST":
            return await (await self.health(scope))(scope, receive, send)
        await (await self.answer(scope))(scope, receive, send)

    async def answer(self, scope: Scope) -> Response:
        """The answer to a request that is not a generation's: from the router's GET routes, or the replicas'
        405, 404 and redirect."""
        path, method = scope["path"], scope["method"]
        route = self.model if path.startswith(MODEL_PATH) else self.get_routes.get(path)
        posted = path in POSTED_PATHS
        if posted or (route is not None and method not in ("GET", "HEAD")):
            allowed = "POST" if posted else "GET, HEAD"
            return error_response(405, wrong_method(method, path, allowed), headers={"Allow": allowed}, path=path)
        if route is not None:
            return await route(scope)
        stripped = path.rstrip("/")
        if path.endswith("/") and (stripped in POSTED_PATHS or stripped in self.get_routes):
            return RedirectResponse(URL(scope=scope).replace(path=stripped))  # 307, as Starlette's redirect_slashes
        return error_response(404, no_route(method, path))

    async def health(self, scope: Scope) -> Response:
        up = [r.url for r in self.router.replicas if r.healthy]
        status = 200 if up else 503
        return JSONResponse({"status": "ok" if up else "unavailable", "replicas_up": up}, status_code=status)

    async def metrics(self, scope: Scope) -> Response:
        return Response(generate_latest(self.router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def version(self, scope: Scope) -> Response:
        return JSONResponse({"version": __version__})  # the replicas' too: one package

    async def models(self, scope: Scope) -> Response:
        """A replica's list, asked with the client's key (replicas started with --api-key want it)."""
        return await self.router.first_healthy_get("/v1/models", forwarded_headers(scope["headers"]))

    async def model(self, scope: Scope) -> Response:
        """A replica's card of one model (its name may hold slashes: a path), or its 404."""
        return await self.router.first_healthy_get(quote(scope["path"]), forwarded_headers(scope["headers"]))

    async def lifespan(self, receive: Receive, send: Send) -> None:
        """Startup: one round of health checks, then the loop in the background; shutdown: stop it, close the
        connections."""
        await receive()  # lifespan.startup
        await self.router.health.check_all()
        checker = asyncio.create_task(self.router.health.loop())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        checker.cancel()
        await self.router.upstream.aclose()
        await send({"type": "lifespan.shutdown.complete"})

