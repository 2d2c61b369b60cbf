"""Replicas as the router sees them, and the policies that pick one for a request.

``cache_aware`` (SGLang's router's rule): send a request where the longest prefix of it was sent before,
unless the load is out of balance (the busiest replica has over ``balance_abs`` more requests than the least
busy, and over ``balance_rel`` times as many), in which case the least loaded replica takes it; a request
with no known prefix goes to the least loaded replica too. ``round_robin`` and ``least_load`` ignore prefixes.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvserve.router.prefix_index import PrefixIndex

POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass(eq=False)
class Replica:
    """One kvserve server behind the router: its load as the router counts it (requests in flight through
    the router) and as the replica reports it (running + waiting, from its /metrics)."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    reported_load: int = 0
    index: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported_load)


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str  # "prefix", "balance", "no_prefix", "round_robin", "least_load": a metrics label
    matched_chunks: int = 0


class RoutingPolicy(ABC):
    @abstractmethod
    def choose(self, replicas: list[Replica], keys: list[bytes]) -> Decision:
        """Pick one of ``replicas`` (healthy, non-empty) for a request whose prompt has prefix ``keys``."""


def least_loaded(replicas: list[Replica]) -> Replica:
    return min(replicas, key=lambda r: r.load)  # min keeps the first of equals: deterministic


class LeastLoad(RoutingPolicy):
    def choose(self, replicas: list[Replica], keys: list[bytes]) -> Decision:
        return Decision(least_loaded(replicas), "least_load")


class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, replicas: list[Replica], keys: list[bytes]) -> Decision:
        return Decision(replicas[next(self._turn) % len(replicas)], "round_robin")


class CacheAware(RoutingPolicy):
    def __init__(self, balance_abs: int = 8, balance_rel: float = 1.5) -> None:
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def choose(self, replicas: list[Replica], keys: list[bytes]) -> Decision:
        if self._imbalanced(replicas):
            return Decision(least_loaded(replicas), "balance")
        matches = [(replica.index.match(keys), replica) for replica in replicas]
        best = max(count for count, _ in matches)
        if best == 0:
            return Decision(least_loaded(replicas), "no_prefix")
        return Decision(least_loaded([r for count, r in matches if count == best]), "prefix", best)

    def _imbalanced(self, replicas: list[Replica]) -> bool:
        loads = [r.load for r in replicas]
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs and high > self.balance_rel * low


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {', '.join(POLICIES)}")
    return {"cache_aware": CacheAware, "round_robin": RoundRobin, "least_load": LeastLoad}[name]()
