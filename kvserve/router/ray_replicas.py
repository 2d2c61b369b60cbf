"""Data-parallel replicas placed by Ray, for clusters: ``kvserve serve MODEL --data-parallel-size N
--data-parallel-backend ray [--ray-address ADDRESS]``.

Each replica is a Ray actor that runs ``kvserve serve`` as a process on the node Ray placed it on (its own
port, ``--port`` + 1 + rank, bound to that node's address); the router runs in front on the driver's node, as
with local replicas. Ray does the placement (``--replica-cpus`` CPUs each) and the restarts: the driver checks
each replica every few seconds, and a replica whose server process has died is killed so that Ray restarts its
actor, which starts a fresh server (on the same port; a replica that Ray moves to another node is re-pointed in
the router). While a replica is down the router sends its requests to the others, as it does for any replica
that stops answering. Ray is an optional dependency (``pip install 'kvserve[ray]'``), imported only here (its
absence is named by ``extras.require_ray``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading

from kvserve.router.app import Router
from kvserve.router.child_process import die_with_parent, serve_command

logger = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 2.0
STATUS_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 60.0


class ReplicaServer:
    """The actor's body: one ``kvserve serve`` process on this node (``ray.remote`` wraps it at start)."""

    def __init__(self, argv: list[str], port: int, env: dict[str, str]) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        self.url = f"http://{host}:{port}"
        self.process = subprocess.Popen(serve_command(argv, "--host", host, "--port", str(port)),
                                        env={**os.environ, **env}, preexec_fn=die_with_parent)

    def status(self) -> tuple[str, bool]:
        """Its URL, and whether its server process still runs."""
        return self.url, self.process.poll() is None

    def stop(self) -> int | None:
        """SIGTERM (the server drains its requests), then a kill after ``DRAIN_TIMEOUT_S``."""
        self.process.terminate()
        try:
            return self.process.wait(DRAIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


class RayReplicas:
    """``size`` replica actors on the Ray cluster at ``address`` (None: a local one), restarted by Ray; each
    replica's process gets ``env`` added to its actor's environment."""

    def __init__(self, argv: list[str], size: int, first_port: int, address: str | None, cpus: float,
                 env: dict[str, str]) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        actor = ray.remote(num_cpus=cpus, max_restarts=-1)(ReplicaServer)
        self._ray = ray
        self.actors = [actor.remote(argv, first_port + rank, env) for rank in range(size)]
        self.urls = [url for url, _ in ray.get([a.status.remote() for a in self.actors])]
        self._stopped = threading.Event()
        self._supervisor: threading.Thread | None = None

    def supervise(self, router: Router, interval: float = SUPERVISE_INTERVAL_S) -> None:
        """Check the replicas every ``interval`` seconds in a background thread until ``stop``."""
        self._supervisor = threading.Thread(target=self._supervise, args=(router, interval), daemon=True,
                                            name="kvserve-ray-supervisor")
        self._supervisor.start()

    def check(self, router: Router) -> None:
        """One round: restart replicas whose server died, re-point those that moved."""
        for rank, actor in enumerate(self.actors):
            try:
                url, running = self._ray.get(actor.status.remote(), timeout=STATUS_TIMEOUT_S)
            except Exception as error:  # the actor is restarting, or its node is gone: Ray handles both
                logger.warning("replica %d does not answer Ray (%s)", rank, error)
                continue
            if not running:
                logger.warning("replica %d's server at %s exited: restarting its actor", rank, url)
                self._ray.kill(actor, no_restart=False)
            elif url != self.urls[rank]:
                logger.warning("replica %d moved from %s to %s", rank, self.urls[rank], url)
                router.move(self.urls[rank], url)
                self.urls[rank] = url

    def stop(self) -> None:
        self._stopped.set()
        if self._supervisor is not None:
            self._supervisor.join()
        stops = [actor.stop.remote() for actor in self.actors]
        try:
            self._ray.get(stops, timeout=DRAIN_TIMEOUT_S + 10)
        except Exception as error:
            logger.warning("replicas did not all stop cleanly: %s", error)
        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)

    def _supervise(self, router: Router, interval: float) -> None:
        while not self._stopped.wait(interval):
            self.check(router)
