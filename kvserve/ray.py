"""kvserve as a Ray Serve application, for users who run Ray clusters:

    serve run kvserve.ray:app model=smollm2-135m-instruct data_parallel_size=2 [routing_policy=cache_aware]
        [replica_cpus=1] [replica_gpus=0] [any `kvserve serve` option as name=value, e.g. max_num_seqs=16
        enable_prefix_caching=false tensor_parallel_size=2]

Two deployments::

    HTTP -> Ray Serve's proxy -> Ingress (1 replica: reads the prompt)
                                    -> handle, routed by PrefixAffinityRouter -> EngineReplica x data_parallel_size

``EngineReplica`` holds one kvserve engine and runs kvserve's own FastAPI app in-process, so every route, error
and guard is the server's. ``Ingress`` reads a request's prompt (Ray Serve's proxy never shows a body to a
request router) and calls the engine replicas through a handle whose request router is ``PrefixAffinityRouter``:
kvserve's routing policy (``kvserve.router.policy``: ``cache_aware`` by default) plugged into Ray Serve's
request-router interface, so a request goes to the replica that was sent the longest prefix of it unless the
load is out of balance. Responses stream through as the replica writes them; a client that disconnects cancels
the replica's generator, which the kvserve app sees as a disconnect and aborts. Ray places and restarts
replicas; ``replica_cpus`` / ``replica_gpus`` are what each tensor-parallel rank of a replica reserves, and a
replica's ranks are placed on one node (with ``distributed_executor_backend=ray``, in the replica's own
placement group: ``replica_options``).

Ray is an optional dependency (``pip install 'kvserve[ray]'``): this module imports it at the top, and nothing
else in kvserve imports this module.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("kvserve.ray needs Ray Serve: pip install 'kvserve[ray]'") from error

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message

from kvserve.config import DEFAULT_MODEL
from kvserve.router.app import ADAPTER_PATHS, FORWARDED_HEADERS, PROXIED_PATHS
from kvserve.router.policy import Replica, RoutingPolicy, make_policy
from kvserve.router.prefix_index import prefix_keys
from kvserve.router.prompts import request_payload, request_text
from kvserve.server.errors import error_response

STOP_GRACE_SECONDS = 5.0  # a cancelled stream's app task gets this long to see the disconnect and abort
HEALTH_CHECK_PERIOD_S = 2.0  # how often Ray Serve asks each engine replica whether its engine runs


@dataclass(frozen=True)
class ProxiedRequest:
    """One HTTP request as the ingress hands it to an engine replica; ``prompt`` is the text the request router
    keys prefixes on (Ray Serve's prefix routers read a ``prompt`` attribute of the request's arguments)."""

    method: str
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...]
    prompt: str = ""


@dataclass(frozen=True)
class ResponseStart:
    """The first item an engine replica streams back: the status and headers, and which replica answered."""

    status: int
    headers: tuple[tuple[str, str], ...]
    replica: str


# ---- the engine replicas -----------------------------------------------------------------------------------------


def serve_arguments(options: dict[str, str]) -> argparse.Namespace:
    """``name=value`` pairs as `kvserve serve` flags, parsed by its own argument definitions: every serve option
    works, and a bad name or value is a ValueError naming it."""
    from kvserve.cli_serve import add_serve_arguments

    parser = argparse.ArgumentParser(prog="kvserve.ray", exit_on_error=False)
    add_serve_arguments(parser)
    argv = [options.get("model", DEFAULT_MODEL)]
    for name, value in options.items():
        if name != "model":
            argv += _flag(parser, name, value)
    try:
        return parser.parse_args(argv)
    except argparse.ArgumentError as error:
        raise ValueError(str(error)) from error


def _flag(parser: argparse.ArgumentParser, name: str, value: str) -> list[str]:
    flag = "--" + name.replace("_", "-")
    action = parser._option_string_actions.get(flag)
    if action is None:
        raise ValueError(f"kvserve serve has no option {name!r}")
    if isinstance(action, argparse.BooleanOptionalAction):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"{name} takes true or false, got {value!r}")
        return [flag if value.lower() == "true" else "--no-" + flag[2:]]
    return [flag, value]


class EngineReplica:
    """One kvserve engine and its FastAPI app, answering ``ProxiedRequest``s in-process."""

    def __init__(self, options: dict[str, str]) -> None:
        from kvserve.server.app import build_app
        from kvserve.cli_serve import engine_config, server_settings
        from kvserve.server.launch import load_engine
        from kvserve.server.state import ServerState

        args = serve_arguments(options)
        self.state = ServerState(server_settings(args))
        load_engine(self.state, engine_config(args), "a Ray Serve replica")
        if self.state.load_error is not None:
            raise RuntimeError(f"kvserve could not load {args.model}: {self.state.load_error}")
        self.app: ASGIApp = build_app(self.state)
        self.name = serve.get_replica_context().replica_id.unique_id

    async def handle(self, request: ProxiedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The response: a ``ResponseStart``, then the body as the app writes it."""
        async for message in call_asgi(self.app, request):
            if message["type"] == "http.response.start":
                headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ()))
                yield ResponseStart(message["status"], headers, self.name)
            elif message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped is restarted."""
        if not self.state.is_ready:
            raise RuntimeError("the kvserve engine is not running")

    def __del__(self) -> None:
        engine = getattr(getattr(self, "state", None), "engine", None)
        if engine is not None:
            engine.shutdown()


async def call_asgi(app: ASGIApp, request: ProxiedRequest) -> AsyncIterator[Message]:
    """Run one request through an ASGI app in this process and yield what it sends. Leaving early (the caller's
    stream was cancelled) is a client disconnect to the app."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()  # after the body, the next message is the disconnect, as from a server
        return {"type": "http.disconnect"}

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
        "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "query_string": b"",
        "root_path": "", "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": ("ray-serve", 0), "server": ("kvserve", 0),
    }
    task = asyncio.create_task(app(scope, receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            yield message
        task.result()  # the app's own exception, if it raised
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=STOP_GRACE_SECONDS)
            task.cancel()


# ---- routing -----------------------------------------------------------------------------------------------------


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve's request-router interface over kvserve's routing policy: each engine replica is a
    ``router.policy.Replica`` (its prefix index and the requests in flight to it from this handle)."""

    def initialize_state(self, routing_policy: str = "cache_aware") -> None:
        self.policy: RoutingPolicy = make_policy(routing_policy)
        self.replicas: dict[ReplicaID, Replica] = {}

    def _replica(self, replica_id: ReplicaID) -> Replica:
        if replica_id not in self.replicas:
            self.replicas[replica_id] = Replica(replica_id.unique_id)
        return self.replicas[replica_id]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        replicas = [self._replica(candidate.replica_id) for candidate in candidate_replicas]
        keys = _prefix_keys(pending_request)
        decision = self.policy.choose(replicas, keys)
        # the prefix counted as sent as soon as it is chosen, as the HTTP router does: a burst of requests with one
        # prefix is chosen for before any is routed, and each would otherwise go by load alone
        decision.replica.index.insert(keys)
        return [[candidate_replicas[replicas.index(decision.replica)]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        replica = self._replica(replica_id)
        replica.in_flight += 1
        replica.index.insert(_prefix_keys(pending_request))  # where Ray Serve sent it, if elsewhere than chosen

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self._replica(replica_id)
        replica.in_flight = max(0, replica.in_flight - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.replicas.pop(replica_id, None)  # a restarted replica holds none of the prompts sent to this one


def _prefix_keys(pending_request: PendingRequest | None) -> list[bytes]:
    if pending_request is None:
        return []
    # Known by its field, not its class: Ray ships the deployment's code by value, so the request unpickled here
    # may be of a copy of ``ProxiedRequest``, which isinstance does not recognise (every prefix then went unkeyed,
    # and requests went by load alone)
    prompts = [arg.prompt for arg in pending_request.args if isinstance(getattr(arg, "prompt", None), str)]
    return prefix_keys(prompts[0]) if prompts else []


# ---- the ingress -------------------------------------------------------------------------------------------------

READ_PATHS = ("/v1/models", "/health")
# a Ray Serve handle call reaches one engine replica, and every replica must serve the same adapters
RUNTIME_LORA_REFUSED = ("loading and unloading LoRA adapters at runtime is not served through Ray Serve (a call "
                        "reaches one engine replica): give the adapters as lora_modules")


class Ingress:
    """Reads each request's prompt and relays it to an engine replica chosen by ``PrefixAffinityRouter``."""

    def __init__(self, engines: DeploymentHandle) -> None:
        self.engines = engines.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        # requests with a prompt, relayed with it for the router: generations, pooling, and tokenizing
        if request.method == "POST" and path in PROXIED_PATHS:
            return await self._generate(request)
        if request.method == "GET" and path in READ_PATHS:
            return await self._relay(request, b"", "")
        if path in ADAPTER_PATHS:
            return error_response(404, RUNTIME_LORA_REFUSED, path=path)
        return error_response(404, f"no route {request.method} {path}", path=path)

    async def _generate(self, request: Request) -> Response:
        body = await request.body()  # a body that is no JSON object goes on, for the replica's own 400
        return await self._relay(request, body, request_text(request.url.path, request_payload(body)))

    async def _relay(self, request: Request, body: bytes, prompt: str) -> Response:
        headers = tuple((k, v) for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS)
        proxied = ProxiedRequest(request.method, request.url.path, body, headers, prompt)
        stream: DeploymentResponseGenerator = self.engines.handle.remote(proxied)
        start = await stream.__anext__()
        response_headers = dict(start.headers) | {"x-kvserve-replica": start.replica}
        response_headers.pop("content-length", None)  # the body is relayed in chunks
        return StreamingResponse(_body(stream), status_code=start.status, headers=response_headers)


async def _body(stream: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
    """The replica's body as it comes; a client that leaves cancels the replica's stream, which aborts."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        stream.cancel()


# ---- the application ---------------------------------------------------------------------------------------------

def replica_options(options: dict[str, str], cpus_per_rank: float, gpus_per_rank: float) -> dict[str, Any]:
    """The deployment options reserving one engine replica: its tensor-parallel group's share per rank, every rank
    on one node. With local worker processes (``worker/parallel.py``) the replica's actor asks for the whole group,
    the workers running inside that reservation; with ``distributed_executor_backend=ray`` it reserves a bundle per
    rank (STRICT_PACK) and runs in bundle 0, and the engine places its rank actors in the other bundles
    (``worker/ray_workers.py``), so nothing is reserved twice."""
    args = serve_arguments(options)
    ranks = args.tensor_parallel_size
    rank = {"num_cpus": cpus_per_rank, **({"num_gpus": gpus_per_rank} if gpus_per_rank else {})}
    if ranks > 1 and args.distributed_executor_backend == "ray":
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
        return {"ray_actor_options": rank, "placement_group_bundles": [bundle] * ranks,
                "placement_group_strategy": "STRICT_PACK"}
    return {"ray_actor_options": {name: amount * ranks for name, amount in rank.items()}}


def app(args: dict[str, str]) -> serve.Application:
    """The application ``serve run kvserve.ray:app name=value ...`` builds (see the module docstring)."""
    options = {name: str(value) for name, value in args.items()}
    num_replicas = int(options.pop("data_parallel_size", "1"))
    routing_policy = options.pop("routing_policy", "cache_aware")
    cpus_per_rank = float(options.pop("replica_cpus", "1"))
    gpus_per_rank = float(options.pop("replica_gpus", "0"))
    make_policy(routing_policy)  # a bad name fails here, before any replica starts
    if options.get("allow_runtime_lora_updating", "false").lower() == "true":
        raise ValueError(RUNTIME_LORA_REFUSED)
    reservation = replica_options(options, cpus_per_rank, gpus_per_rank)  # likewise a bad serve option
    engines = serve.deployment(EngineReplica, name="kvserve-engine").options(
        num_replicas=num_replicas,
        **reservation,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"routing_policy": routing_policy},
        ),
        max_ongoing_requests=1024,  # the engine batches and queues; Ray Serve should not queue in front of it
        # a replica whose engine failed (check_health) is replaced within seconds, not Ray Serve's default 10 s
        # period: requests sent to it meanwhile are answered 503
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    ingress = serve.deployment(Ingress, name="kvserve-ingress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096,
    )
    return ingress.bind(engines.bind(options))
