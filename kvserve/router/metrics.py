"""The router's Prometheus metrics, shown on its /metrics: its own counters (``kvserve_router:*``: requests and
prefix hits per replica, decisions by reason, retries, replica health), and each healthy replica's own page
(``kvserve:*``) with a ``replica`` label; ``queue_length`` reads a replica's queue, its load, off that page."""

from __future__ import annotations

import logging
import math
import re
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.policy import Decision

logger = logging.getLogger(__name__)

QUEUE_METRICS = ("kvserve:num_requests_running", "kvserve:num_requests_waiting")
# a queue gauge's samples: its name, its labels, its value (Prometheus' text format)
_QUEUE_SAMPLE = re.compile(rf"^(?:{'|'.join(map(re.escape, QUEUE_METRICS))})(?:{{[^\n]*}})?[ \t]+(\S+)",
                           re.MULTILINE)


class RouterMetrics:
    """Everything the router's /metrics shows, in one registry: its counters, its gauge of each replica's health
    (mirroring ``Replica.healthy``, which ``health.HealthChecker`` sets) and the replicas' own pages."""

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series, as on the server's own page (server/metrics.py)
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
        self.replica_pages = ReplicaPages()
        self.registry.register(self.replica_pages)

    def count(self, decision: Decision) -> None:
        """A request handed to ``decision.replica``: its request, its prefix hits and the decision's reason."""
        url = decision.replica.url
        self.requests.labels(url).inc()
        self.prefix_hits.labels(url).inc(decision.matched_chunks)
        self.decisions.labels(decision.reason).inc()

    def set_health(self, url: str, healthy: bool) -> None:
        self.healthy.labels(url).set(1 if healthy else 0)


class ReplicaPages:
    """The replicas' own metrics (``kvserve:*``, from the page each health check reads), each sample labelled
    with its ``replica``: the router's port shows what one server's would (vLLM's data-parallel server shows
    each engine's alike), so dashboards survive scaling from one replica to N. A replica down has none. Pages are
    kept as text and parsed when the router's /metrics is read: parsing each replica's 23 KB page every second
    was three quarters of an idle router's CPU."""

    def __init__(self) -> None:
        self.pages: dict[str, str] = {}  # by replica URL: its page, as last read

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}  # one family (one HELP and TYPE) over every replica
        for url, page in self.pages.items():
            try:
                families = list(text_string_to_metric_families(page))
            except ValueError as e:  # its queue read, the rest of it not: shown without it
                logger.debug("replica %s: its /metrics page does not parse (%s)", url, e)
                continue
            for family in families:
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                into.samples += [sample._replace(labels={**sample.labels, "replica": url}) for sample in family.samples]
        return iter(merged.values())


def queue_length(page: str) -> int:
    """A replica's requests running and waiting, read off the lines of its /metrics page that hold them;
    ValueError for a page that holds none (not a kvserve server's: a proxy's error page) or a value that is not a
    finite number."""
    values = [float(value) for value in _QUEUE_SAMPLE.findall(page)]
    if not values:
        raise ValueError(f"no {' or '.join(QUEUE_METRICS)} on it")
    if not all(map(math.isfinite, values)):
        raise ValueError(f"a queue of {values}")
    return int(sum(values))
