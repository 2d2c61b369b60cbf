"""``kvserve router --worker URL ...`` (replicas started elsewhere) and ``kvserve serve --data-parallel-size N``
(N replicas started here, each its own process on its own port, the router in front on the usual port).

    kvserve serve MODEL --port 8000 --data-parallel-size 2
        -> kvserve serve MODEL --port 8001      (replica 0)
        -> kvserve serve MODEL --port 8002      (replica 1)
        -> router on 8000, cache-aware by default; SIGTERM stops the router, then the replicas (they drain)
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import threading

import uvicorn

from kvserve.router.app import Router, build_router_app
from kvserve.router.policy import POLICIES, make_policy

logger = logging.getLogger(__name__)


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", action="append", required=True, metavar="URL",
                        help="a kvserve replica's base URL (repeat for each replica)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_policy_argument(parser)


def add_policy_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--routing-policy", default="cache_aware", choices=POLICIES,
                        help="cache_aware: the replica that was sent the longest prefix unless load is out of "
                             "balance; round_robin; least_load")


def run_router(args: argparse.Namespace) -> int:
    router = Router(args.worker, make_policy(args.routing_policy))
    logger.info("kvserve router on http://%s:%d -> %s (%s)", args.host, args.port, ", ".join(args.worker),
                args.routing_policy)
    uvicorn.run(build_router_app(router), host=args.host, port=args.port, log_level="warning")
    return 0


def serve_data_parallel(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.data_parallel_size`` replicas of ``kvserve serve`` (the same flags, ports after the router's)
    and run the router in front until it is stopped; then stop the replicas."""
    size = args.data_parallel_size
    replica_argv = _without_flags(argv, ("--data-parallel-size", "--port", "--routing-policy"))
    ports = [args.port + 1 + i for i in range(size)]
    replicas = [subprocess.Popen([sys.executable, "-m", "kvserve.cli", *replica_argv, "--port", str(port)])
                for port in ports]
    router_args = argparse.Namespace(worker=[f"http://127.0.0.1:{port}" for port in ports], host=args.host,
                                     port=args.port, routing_policy=args.routing_policy)
    # uvicorn re-raises the signal that stopped it once it has shut down: ignored here, so that the replicas
    # are stopped below instead of being left running by a process killed on the spot
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run_router(router_args)
    finally:
        _stop(replicas)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without the given flags and their values (``--flag value`` or ``--flag=value``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept


def _stop(replicas: list[subprocess.Popen]) -> None:
    for process in replicas:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # each drains its requests, as a lone server does
    timer = threading.Timer(60.0, lambda: [p.kill() for p in replicas if p.poll() is None])
    timer.start()
    for process in replicas:
        process.wait()
    timer.cancel()
