"""The router's health checks: every ``interval`` seconds each replica's /health is asked and, while it is up,
its /metrics read (its queue, the policy's view of its load; its page, shown on the router's /metrics). A
replica that fails a check, or that the proxy finds refusing or losing a request (``mark_down``), is routed
around until a check finds it up again, and ``on_up`` (the router's replay of its runtime LoRA loads) says it is
ready: until then it serves nothing."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from kvserve.router.metrics import RouterMetrics, queue_length
from kvserve.router.policy import Replica
from kvserve.router.upstream import ConnectFailed, Upstream, UpstreamLost

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
GET_TIMEOUT_S = 30.0  # any other GET of a replica: its /metrics page, a model list or card


class HealthChecker:
    """Owns each replica's ``healthy`` flag (and its ``replica_healthy`` gauge) and ``reported_load``.
    ``replicas`` is the router's list itself, so a replica it re-points (``Router.move``) is checked too.
    ``on_up`` is awaited for a replica found up after it was down (or new): False keeps it down, to be tried again at
    the next check."""

    def __init__(self, replicas: list[Replica], upstream: Upstream, metrics: RouterMetrics,
                 interval: float, on_up: Callable[[Replica], Awaitable[bool]] | None = None) -> None:
        self.replicas = replicas
        self.on_up = on_up
        self.upstream = upstream
        self.metrics = metrics
        self.interval = interval
        self.checked: set[str] = set()  # replicas a check has answered about (their first state is logged)
        self.unreadable: set[str] = set()  # replicas whose /metrics page did not read at their last check

    async def loop(self) -> None:
        """Rounds for as long as the router runs; a round that fails is logged and the next one comes (a loop that
        ended left every replica as its last round found it, unlogged)."""
        while True:
            try:
                await self.check_all()
            except Exception:
                logger.exception("a round of health checks failed; the next in %g s", self.interval)
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
        try:
            healthy = (await self.upstream.get(replica.url + "/health", HEALTH_TIMEOUT_S))[0] == 200
            if healthy and not replica.healthy and self.on_up is not None:
                healthy = await self.on_up(replica)
            if healthy:
                await self._read_load(replica)
        except (ConnectFailed, UpstreamLost):
            healthy = False
        if not healthy:
            self.metrics.replica_pages.pages.pop(replica.url, None)
        self._log_change(replica, healthy)
        self._set_health(replica, healthy)

    async def _read_load(self, replica: Replica) -> None:
        """The replica's page and queue from its /metrics; a page that holds no queue (a proxy's error page)
        leaves its load unknown (0: the router's own count of what it sent stands), said once until it reads."""
        status, _, body = await self.upstream.get(replica.url + "/metrics", GET_TIMEOUT_S)
        try:
            if status != 200:
                raise ValueError(f"status {status}")
            page = body.decode()
            load = queue_length(page)
        except ValueError as e:  # UnicodeDecodeError is one
            if replica.url not in self.unreadable:
                logger.warning("replica %s: its /metrics page does not read (%s); its load is taken as unknown",
                               replica.url, str(e)[:200])
            self.unreadable.add(replica.url)
            self.metrics.replica_pages.pages.pop(replica.url, None)
            replica.reported_load = 0
            return
        self.unreadable.discard(replica.url)
        self.metrics.replica_pages.pages[replica.url] = page
        replica.reported_load = load

    def _log_change(self, replica: Replica, healthy: bool) -> None:
        """A replica's first state (one still loading is not up yet, at start) and its later changes: down is
        a warning, back up is news."""
        if replica.url not in self.checked:
            self.checked.add(replica.url)
            logger.info("replica %s is %s", replica.url, "up" if healthy else "not up yet")
        elif healthy != replica.healthy:
            logger.log(logging.INFO if healthy else logging.WARNING, "replica %s is %s", replica.url,
                       "back up" if healthy else "down")

    def _set_health(self, replica: Replica, healthy: bool) -> None:
        replica.healthy = healthy
        self.metrics.set_health(replica.url, healthy)
