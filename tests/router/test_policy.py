"""Routing policies: prefix affinity, balance under skew, round robin, least load."""

from __future__ import annotations

import pytest

from kvserve.router.policy import CacheAware, LeastLoad, Replica, RoundRobin, make_policy
from kvserve.router.prefix_index import CHUNK_CHARS, prefix_keys

PROMPT = prefix_keys("p" * CHUNK_CHARS * 4)


def replicas(*loads: int) -> list[Replica]:
    return [Replica(f"http://r{i}", in_flight=load) for i, load in enumerate(loads)]


def test_cache_aware_sends_a_known_prefix_where_it_went() -> None:
    group = replicas(3, 0)
    group[0].index.insert(PROMPT)
    decision = CacheAware().choose(group, PROMPT)
    assert decision.replica is group[0] and decision.reason == "prefix" and decision.matched_chunks == 4


def test_cache_aware_sends_an_unknown_prefix_to_the_least_loaded() -> None:
    group = replicas(3, 1)
    assert CacheAware().choose(group, PROMPT).replica is group[1]


def test_cache_aware_balances_when_the_prefix_holder_is_swamped() -> None:
    group = replicas(20, 2)
    group[0].index.insert(PROMPT)
    decision = CacheAware(balance_abs=8, balance_rel=1.5).choose(group, PROMPT)
    assert decision.replica is group[1] and decision.reason == "balance"


def test_the_replica_reported_queue_counts_as_load() -> None:
    group = replicas(0, 0)
    group[0].reported_load = 5
    assert LeastLoad().choose(group, PROMPT).replica is group[1]


def test_round_robin_cycles() -> None:
    group = replicas(0, 0, 0)
    policy = RoundRobin()
    assert [policy.choose(group, PROMPT).replica for _ in range(4)] == [group[0], group[1], group[2], group[0]]


def test_an_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
