"""The router's health checks: every ``interval`` seconds each replica's /health is asked and, while it is up,
its /metrics read (its queue, the policy's view of its load; its page, shown on the router's /metrics). A
replica that fails a check, or that the proxy finds refusing or losing a request (``mark_down``), is routed
around until a check finds it up again."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.metrics import RouterMetrics, queue_length
from kvserve.router.policy import Replica
from kvserve.router.upstream import ConnectFailed, Upstream, UpstreamLost

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
GET_TIMEOUT_S = 30.0  # any other GET of a replica: its /metrics page, a model list or card


class HealthChecker:
    """Owns each replica's ``healthy`` flag (and its ``replica_healthy`` gauge) and ``reported_load``.
    ``replicas`` is the router's list itself, so a replica it re-points (``Router.move``) is checked too."""

    def __init__(self, replicas: list[Replica], upstream: Upstream, metrics: RouterMetrics,
                 interval: float) -> None:
        self.replicas = replicas
        self.upstream = upstream
        self.metrics = metrics
        self.interval = interval

    async def loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

    async def check_all(self) -> None:
        """One round over every replica at once; then the upstream's idle connections too old to reuse are
        closed, so that they do not linger between requests."""
        await asyncio.gather(*(self._check(replica) for replica in self.replicas))
        self.upstream.prune()

    def mark_down(self, replica: Replica) -> None:
        """Route around ``replica`` (it refused or lost a request) until a check finds it up."""
        self._set_health(replica, False)

    async def _check(self, replica: Replica) -> None:
        pages = self.metrics.replica_pages.pages
        try:
            healthy = (await self.upstream.get(replica.url + "/health", HEALTH_TIMEOUT_S))[0] == 200
            if healthy:
                page = (await self.upstream.get(replica.url + "/metrics", GET_TIMEOUT_S))[2]
                pages[replica.url] = list(text_string_to_metric_families(page.decode()))
                replica.reported_load = queue_length(pages[replica.url])
        except (ConnectFailed, UpstreamLost):
            healthy = False
        if not healthy:
            pages.pop(replica.url, None)
        if healthy != replica.healthy:
            logger.warning("replica %s is %s", replica.url, "back up" if healthy else "down")
        self._set_health(replica, healthy)

    def _set_health(self, replica: Replica, healthy: bool) -> None:
        replica.healthy = healthy
        self.metrics.set_health(replica.url, healthy)
