"""Disk reads against recomputing: the disk is read until both costs are measured, and skipped only when a
block's read measured well over the cost of computing its tokens; then the engine recomputes, with the same
output, and counts the blocks it did not read."""

from __future__ import annotations

import pytest

from kvserve.kv.reload_costs import MIN_OBSERVATIONS, MIN_PREFILL_TOKENS, SKIP_FACTOR, ReloadCosts
from kvserve.kv.tiers import TieredStore
from tests.engine.test_kv_offload import SMALL_POOL, _llm, _prompts, _run


def test_only_mostly_prefill_steps_are_observed_and_averaged() -> None:
    costs = ReloadCosts()
    costs.observe_step(MIN_PREFILL_TOKENS - 1, MIN_PREFILL_TOKENS - 1, 1.0)  # too few prefill tokens
    costs.observe_step(100, 300, 1.0)  # mostly decodes
    costs.observe_step(100, 150, 0.0)  # no time
    assert costs.num_observations == 0
    costs.observe_step(100, 150, 0.01)
    assert costs.seconds_per_prefill_token == pytest.approx(1e-4)
    costs.observe_step(100, 100, 0.05)
    assert costs.num_observations == 2 and 1e-4 < costs.seconds_per_prefill_token < 5e-4


def test_the_disk_is_read_unless_both_costs_say_recomputing_is_much_cheaper() -> None:
    costs = ReloadCosts()
    for _ in range(MIN_OBSERVATIONS):
        costs.observe_step(1000, 1000, 1e-3)  # 1 us a token: 16 us a block of 16
    slow_read = SKIP_FACTOR * 16e-6 * 1.01
    assert not costs.disk_read_pays(slow_read, MIN_OBSERVATIONS, 16)
    assert costs.disk_read_pays(slow_read * 0.98, MIN_OBSERVATIONS, 16)  # within the factor: read
    assert costs.disk_read_pays(slow_read, MIN_OBSERVATIONS - 1, 16)  # too few reads measured
    assert costs.disk_read_pays(None, 0, 16)
    assert ReloadCosts().disk_read_pays(slow_read, 100, 16)  # no prefill measured


def test_an_engine_whose_disk_measures_slow_recomputes_with_the_same_tokens(
    tiny_checkpoints, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted engine finds the first engine's blocks on the disk, but its disk measures 10 s a block: once
    fresh prompts have shown what a prefill token costs, it recomputes the prefixes instead of reading them."""
    path = tiny_checkpoints["llama"]
    prompts = _prompts(200, seed=2)
    first = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    expected = _run(first, prompts)
    first.engine.flush_kv_offload()
    monkeypatch.setattr(TieredStore, "disk_read_cost", lambda self: (10.0, 100))  # 10 s a block, 100 reads seen
    restarted = _llm(path, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    fresh = [[300 + i] * (MIN_PREFILL_TOKENS + 8) for i in range(MIN_OBSERVATIONS + 1)]
    _run(restarted, fresh)  # a prefill each, nothing on the disk for them: what a prefill token costs
    costs = restarted.engine.core.kv_manager.reload_costs
    assert costs.num_observations >= MIN_OBSERVATIONS and costs.seconds_per_prefill_token > 0, costs
    assert _run(restarted, prompts) == expected
    stats = restarted.stats()
    assert stats["kv_offload_disk_reads_skipped"] > 0 and stats["kv_offload_disk_hit_tokens"] == 0, stats
