"""``kvserve router --worker URL ...`` (replicas started elsewhere) and ``kvserve serve --data-parallel-size N``
(N replicas, each its own process on its own port, the router in front on the usual port): started here
(``--data-parallel-backend mp``), or placed on a Ray cluster (``ray``, see ``ray_replicas``).

    kvserve serve MODEL --port 8000 --data-parallel-size 2
        -> kvserve serve MODEL --port 8001      (replica 0)
        -> kvserve serve MODEL --port 8002      (replica 1)
        -> router on 8000, cache-aware by default; SIGTERM stops the router, then the replicas (they drain)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable

import uvicorn
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from kvserve.router.app import Router, RouterApp
from kvserve.router.child_process import die_with_parent, serve_command
from kvserve.router.policy import POLICIES, make_policy
from kvserve.extras import require_ray
from kvserve.host_limits import SHARED_BY_ENV, quota_threads
from kvserve.logs import add_log_arguments, configure_logging, uvicorn_logging
from kvserve.router.ray_replicas import RayReplicas
from kvserve.router.upstream import DEFAULT_RESPONSE_TIMEOUT_S, Upstream
from kvserve.server.cors import CorsPolicy, add_cors_arguments
from kvserve.server.sockets import (LISTEN_FD_ENV, MAX_PORT, UVICORN_PROTOCOLS, http_url, listening_socket,
                                    raise_open_file_limit)
from kvserve.server.environment import api_keys, api_keys_variable, warn_of_vllm_environment
from kvserve.server.state import DEFAULT_MAX_BODY_BYTES


logger = logging.getLogger(__name__)

ROUTER_HELP = "route OpenAI requests to kvserve replicas, cache-aware"
LOCAL_HOST = "127.0.0.1"  # where local replicas listen: only their router reaches them
# after a replica's --shutdown-timeout: its uvicorn's close of the answers it aborted, and their way through the
# router, which stops waiting for its connections after that
REPLICA_CLOSE_SECONDS = 10.0
MULTI_VALUE_FLAGS = ("--api-key",)  # of the router's flags, those that take every word up to the next flag
NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")  # argparse's own test, for a parser without such flags


def main(argv: list[str]) -> int:
    """``kvserve router ARGS``: its own parser, so that starting it imports no engine code (``kvserve.cli``
    hands ``router`` here before it builds the parser of the other subcommands)."""
    parser = argparse.ArgumentParser(prog="kvserve router", description=ROUTER_HELP, allow_abbrev=False)
    add_router_arguments(parser)
    return run_router(parser.parse_args(argv))


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="append", required=True, metavar="URL",
                        help="a kvserve replica's base URL (repeat for each replica)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies are answered 413, as by the replicas' own flag (default: "
                             "%(default)s, 4 MiB)")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY', one of the keys given, before a request's body "
                             "is read, as the replicas do (/health and /metrics stay open; the header goes on to "
                             "the replicas, which check their own; `serve --data-parallel-size N --api-key KEY` "
                             "sets both; default: $KVSERVE_API_KEY's lines, else vLLM's $VLLM_API_KEY, else no key)")
    add_policy_argument(parser)
    add_upstream_timeout_argument(parser)
    add_log_arguments(parser, access_log=False)
    add_cors_arguments(parser)


def add_policy_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--routing-policy", default="cache_aware", choices=POLICIES,
                        help="cache_aware: the replica that was sent the longest prefix unless load is out of "
                             "balance; round_robin; least_load (default: %(default)s)")


def add_upstream_timeout_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream-timeout", type=_positive_seconds, default=DEFAULT_RESPONSE_TIMEOUT_S,
                        metavar="SECONDS",
                        help="give up on a replica that sends nothing for this long: no response head (a "
                             "non-streamed one comes when its generation is done) or no next part of a stream; "
                             "the client gets a 504, or a stream ends with an error event (default: %(default)g)")


def _positive_seconds(text: str) -> float:
    """A flag's number of seconds, checked at parsing (before ``serve --data-parallel-size`` starts replicas)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return seconds


def build_router(urls: list[str], args: argparse.Namespace) -> Router:
    """The router the flags describe, in front of ``urls``."""
    return Router(urls, make_policy(args.routing_policy), Upstream(response_timeout=args.upstream_timeout),
                  max_body_bytes=args.max_body_bytes, api_keys=api_keys(args.api_key))


def run_router(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    warn_of_vllm_environment()
    _run(build_router(args.worker, args), listening_socket(args.host, args.port), args)
    return 0


class RouterServer(uvicorn.Server):
    """uvicorn, which also stops once ``should_stop()`` says so (checked on each of uvicorn's ticks);
    ``stopped_by_check`` then tells that stop from one by a signal. ``on_shutdown`` runs as its shutdown begins."""

    def __init__(self, config: uvicorn.Config, should_stop: Callable[[], bool],
                 on_shutdown: Callable[[], None] = lambda: None) -> None:
        super().__init__(config)
        self.should_stop = should_stop
        self.on_shutdown = on_shutdown
        self.stopped_by_check = False

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_shutdown()
        await super().shutdown(sockets)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):  # a signal first: ^C also reaches the replicas, which then exit
            return True
        self.stopped_by_check = self.should_stop()
        return self.stopped_by_check


def _run(router: Router, sock: socket.socket, args: argparse.Namespace,
         should_stop: Callable[[], bool] = lambda: False, on_shutdown: Callable[[], None] = lambda: None,
         shutdown_seconds: float | None = None) -> bool:
    """Serve ``router`` on ``sock`` until a signal, or until ``should_stop()``: True in that case. ``args``: the
    routing policy, the log level and the CORS policy; ``on_shutdown`` runs as the shutdown begins, which waits
    for open connections up to ``shutdown_seconds`` (None: until they close)."""
    host, port = sock.getsockname()[:2]
    raise_open_file_limit()
    logger.info("kvserve router on %s -> %s (%s)", http_url(host, port), ", ".join(r.url for r in router.replicas),
                args.routing_policy)
    app = router_app(router, CorsPolicy.from_cli_args(args))
    config = uvicorn.Config(app, timeout_graceful_shutdown=shutdown_seconds,
                            **uvicorn_logging(args.log_level, access_log=False), **UVICORN_PROTOCOLS)
    server = RouterServer(config, should_stop, on_shutdown)
    server.run(sockets=[sock])
    return server.stopped_by_check


def router_app(router: Router, cors: CorsPolicy) -> ASGIApp:
    """The router's ASGI app: ``RouterApp`` behind the CORS policy (a preflight answered before the API key)."""
    return CORSMiddleware(RouterApp(router), **cors.middleware_options())


def add_data_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="replicas to start, each its own process on the ports after --port, behind a router "
                             "on --port (kvserve.router); 1: no router (default: %(default)s)")
    parser.add_argument("--data-parallel-backend", default="mp", choices=("mp", "ray"),
                        help="mp: replica processes on this machine; ray: Ray actors placed on a Ray cluster "
                             "(pip install 'kvserve[ray]'; default: %(default)s)")
    parser.add_argument("--ray-address", default=None,
                        help="the Ray cluster to join (default: a local one, or $RAY_ADDRESS)")
    parser.add_argument("--replica-cpus", type=float, default=1.0,
                        help="CPUs Ray reserves for each replica (default: %(default)g)")
    add_upstream_timeout_argument(parser)  # the router's; --max-body-bytes is the replicas' flag, used by both


# the router's and Ray's flags of `kvserve serve`, which only a deployment of several replicas (or Ray's) reads
_ROUTER_FLAGS = ("routing_policy", "upstream_timeout", "data_parallel_backend")
_RAY_FLAGS = ("ray_address", "replica_cpus")


def check_data_parallel_flags(args: argparse.Namespace) -> None:
    """ValueError naming a flag that the deployment asked for would ignore (a mistyped ``--data-parallel-size``
    left one server and no hint): the router's without replicas, Ray's without Ray."""
    defaults = argparse.ArgumentParser()
    add_data_parallel_arguments(defaults)
    add_policy_argument(defaults)

    def refuse_given(names: tuple[str, ...], needed: str) -> None:
        given = ["--" + name.replace("_", "-") for name in names if getattr(args, name) != defaults.get_default(name)]
        if given:
            raise ValueError(f"{', '.join(given)}: read only with {needed}; this deployment would ignore them")

    if args.data_parallel_size == 1:
        refuse_given(_ROUTER_FLAGS + _RAY_FLAGS, "--data-parallel-size > 1")
    if args.data_parallel_backend != "ray":
        refuse_given(_RAY_FLAGS, "--data-parallel-backend ray")
    if not args.replica_cpus > 0:
        raise ValueError(f"--replica-cpus must be > 0, got {args.replica_cpus}")


def serve_data_parallel(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.data_parallel_size`` replicas of ``kvserve serve`` (the same flags, ports after the router's)
    and run the router in front until it is stopped, or until every local replica has exited (none could load:
    1); then stop the replicas."""
    configure_logging(args.log_level)
    size = args.data_parallel_size
    if args.port + size > MAX_PORT:
        raise ValueError(f"--data-parallel-size {size} replicas need the ports after --port {args.port}: "
                         f"{args.port + size} is over {MAX_PORT}")
    sock = listening_socket(args.host, args.port)  # before any replica starts: a port in use stops nothing yet
    replica_argv, replica_env = replica_command(args, argv)
    if args.data_parallel_backend == "ray":
        require_ray("--data-parallel-backend ray")
        replicas: LocalReplicas | RayReplicas = RayReplicas(replica_argv, size, args.port + 1, args.ray_address,
                                                            args.replica_cpus, replica_env)
    else:
        # every replica's port taken here, before any starts, and handed to it: a port in use stops nothing yet,
        # and no other server can take one while its replica loads (the router would route to that server)
        sockets = [listening_socket(LOCAL_HOST, args.port + 1 + i) for i in range(size)]
        replicas = LocalReplicas(replica_argv, sockets, replica_env)
    router = build_router(replicas.urls, args)
    if isinstance(replicas, RayReplicas):
        replicas.supervise(router)
    exit_codes = replicas.exit_codes if isinstance(replicas, LocalReplicas) else lambda: None
    # the replicas drain as the router's shutdown begins (their streams, which the router waits for, end within
    # --shutdown-timeout), not once the router has waited for every stream to end by itself
    stopping = threading.Thread(target=replicas.stop, name="kvserve-replicas-stop")
    # uvicorn re-raises the signal that stopped it once it has shut down: ignored here, so that the replicas
    # are stopped below instead of being left running by a process killed on the spot
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        replicas_gone = _run(router, sock, args, should_stop=lambda: exit_codes() is not None,
                             on_shutdown=stopping.start, shutdown_seconds=args.shutdown_timeout + REPLICA_CLOSE_SECONDS)
    finally:
        if stopping.ident is None:  # the router never began its shutdown
            stopping.start()
        stopping.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if replicas_gone:
        codes = ", ".join(map(str, exit_codes() or []))
        print(f"kvserve: error: every replica exited (exit codes {codes}), leaving the router nothing to route to; "
              "their errors are above", file=sys.stderr, flush=True)
        return 1
    return 0


def replica_command(args: argparse.Namespace, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """A replica's ``kvserve serve`` arguments (``argv`` without the router's flags) and the environment it
    adds: the API keys go in ``$KVSERVE_API_KEY``, out of the replicas' command lines (which ``ps`` shows); local
    replicas share the container's CPU quota, a share each in ``$OMP_NUM_THREADS`` (each took all of it), and
    replicas on this machine (local ones, and Ray's on the local cluster it starts without ``--ray-address``) its
    memory (``SHARED_BY_ENV``: each replica's KV cache checked against, and its default budget taken from, its
    share). Ray sets its actors' threads from ``--replica-cpus``."""
    replica_argv = _without_flags(argv, ("--data-parallel-size", "--port", "--routing-policy",
                                         "--data-parallel-backend", "--ray-address", "--replica-cpus", "--host",
                                         "--upstream-timeout", "--api-key"))
    env = api_keys_variable(api_keys(args.api_key))
    if args.data_parallel_backend == "mp" or args.ray_address is None:  # all on this machine
        env[SHARED_BY_ENV] = str(args.data_parallel_size)
    threads = quota_threads(args.data_parallel_size) if args.data_parallel_backend == "mp" else None
    return replica_argv, env if threads is None else {**env, "OMP_NUM_THREADS": str(threads)}


class LocalReplicas:
    """Replica processes on this machine, each serving on one of ``sockets`` (listening on ``LOCAL_HOST``), which
    it inherits; with ``env`` added to this process's environment."""

    def __init__(self, argv: list[str], sockets: list[socket.socket], env: dict[str, str]) -> None:
        ports = [sock.getsockname()[1] for sock in sockets]
        self.urls = [http_url(LOCAL_HOST, port) for port in ports]
        self.processes = [subprocess.Popen(serve_command(argv, "--port", str(port)),
                                           env={**os.environ, **env, LISTEN_FD_ENV: str(sock.fileno())},
                                           pass_fds=(sock.fileno(),), preexec_fn=die_with_parent)
                          for sock, port in zip(sockets, ports)]
        for sock in sockets:
            sock.close()  # the replica's now

    def exit_codes(self) -> list[int] | None:
        """Every replica's exit code once all of them have exited; None while any runs."""
        codes = [process.poll() for process in self.processes]
        return None if None in codes else codes

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # each drains its requests, as a lone server does
        timer = threading.Timer(60.0, lambda: [p.kill() for p in self.processes if p.poll() is None])
        timer.start()
        for process in self.processes:
            process.wait()
        timer.cancel()


def _is_value(arg: str) -> bool:
    """Whether argparse reads ``arg`` as a value, not a flag: what does not start with '-', '-' alone, and a
    negative number (the parsers have no flag that looks like one)."""
    return not arg.startswith("-") or arg == "-" or NEGATIVE_NUMBER.fullmatch(arg) is not None


def _without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without the given flags and their values (``--flag value`` or ``--flag=value``; a
    ``MULTI_VALUE_FLAGS`` flag's every value, up to the next flag or ``--``, as argparse reads them)."""
    kept, skip_next, skip_words = [], False, False
    for arg in argv:
        if skip_next or (skip_words and _is_value(arg)):
            skip_next = False
            continue
        skip_words = False
        name, has_value = arg.split("=", 1)[0], "=" in arg
        if name in flags:
            skip_next = not has_value and name not in MULTI_VALUE_FLAGS
            skip_words = not has_value and name in MULTI_VALUE_FLAGS
            continue
        kept.append(arg)
    return kept
