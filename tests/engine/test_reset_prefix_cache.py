"""``reset_prefix_cache`` (vLLM's): every cached block no request holds let go of at once, the stats true after it;
with a request running, the blocks it holds stay (its output unchanged) and the call says False; the KV tiers
emptied only with ``reset_connector``. Gemma 3 runs in KV cache groups (window blocks cached beside the nodes)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import InvalidParameter
from tests.conftest import assert_all_blocks_free, greedy_token_ids

MAX_NEW = 6


def _prompts(seed: int = 0) -> list[list[int]]:
    """Two prompts of 7 to 9 blocks of 4 tokens sharing their first 20 tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 200) for _ in range(20)]
    return [system + [rng.randrange(3, 200) for _ in range(rng.randrange(8, 16))] for _ in range(2)]


def _llm(path: Path, **options) -> LLM:
    options.setdefault("num_kv_blocks", 128)
    return LLM(str(path), dtype="float32", block_size=4, enable_prefix_caching=True, **options)


def _check_integrity(engine: LLMEngine) -> None:
    scheduler = engine.core.scheduler
    engine.core.kv_manager.check_integrity(scheduler.requests.values())


def _tier_hits(llm: LLM) -> int:
    """Tokens found in the tiers: the disk tier's writes pass through host rows, where a hit finds them first."""
    stats = llm.stats()
    return stats["kv_offload_host_hit_tokens"] + stats["kv_offload_disk_hit_tokens"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request: pytest.FixtureRequest, tiny_checkpoints) -> Path:
    return tiny_checkpoints[request.param]


def test_a_reset_between_generates_empties_the_cache_and_the_next_run_misses(checkpoint) -> None:
    llm, prompts = _llm(checkpoint), _prompts()
    first = greedy_token_ids(llm, prompts, MAX_NEW)
    before = llm.stats()
    assert before["prefix_cache_blocks"] > 0 and before["prefix_cache_hits"] > 0, before
    assert llm.reset_prefix_cache() is True
    after = llm.stats()
    assert after["prefix_cache_blocks"] == 0, after
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"]  # counters since start never go back
    assert after["prefix_cache_evictions"] == before["prefix_cache_evictions"]  # a reset evicts nothing to make room
    assert_all_blocks_free(llm)
    _check_integrity(llm.engine)
    assert greedy_token_ids(llm, prompts[:1], MAX_NEW) == first[:1]
    assert llm.stats()["prefix_cache_hits"] == before["prefix_cache_hits"]  # the first prompt found nothing cached
    assert llm.reset_prefix_cache() is True  # and again: an empty cache resets
    _check_integrity(llm.engine)


def test_a_reset_with_a_request_running_keeps_its_blocks_and_its_output(checkpoint) -> None:
    prompts = _prompts(1)
    alone = greedy_token_ids(_llm(checkpoint), prompts[1:], MAX_NEW)[0][0]
    llm = _llm(checkpoint)
    greedy_token_ids(llm, prompts[:1], MAX_NEW)  # cached, no request holds them
    engine = llm.engine
    engine.add_request("running", {"prompt_token_ids": prompts[1]}, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    engine.step()
    engine.step()
    running = engine.core.scheduler.requests["running"]
    held = list(running.block_ids)
    num_unheld = engine.core.kv_manager.pool.num_evictable_blocks
    assert num_unheld > 0 and held
    assert engine.reset_prefix_cache() is False  # its prompt's blocks are cached, and it holds them
    pool = engine.core.kv_manager.pool
    assert pool.num_evictable_blocks == 0
    assert running.block_ids == held and all(pool.ref_count(b) == 1 for b in held)
    stats = engine.stats()
    assert 0 < stats["prefix_cache_blocks"] <= len(held) * stats["kv_cache_groups"], stats
    _check_integrity(engine)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step(final_only=True)
    assert [list(out.outputs[0].token_ids) for out in outputs] == [alone]
    assert llm.stats()["prefix_cache_blocks"] > 0  # its blocks, released into the cache as it finished
    assert llm.reset_prefix_cache() is True
    assert llm.stats()["prefix_cache_blocks"] == 0
    assert_all_blocks_free(llm)
    _check_integrity(engine)


def test_reset_running_requests_is_refused_by_name(tiny_checkpoints) -> None:
    llm = _llm(tiny_checkpoints["llama"])
    with pytest.raises(InvalidParameter, match="reset_running_requests"):
        llm.reset_prefix_cache(reset_running_requests=True)


def test_with_prefix_caching_off_a_reset_has_nothing_to_do(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    greedy_token_ids(llm, _prompts(), MAX_NEW)
    assert llm.reset_prefix_cache() is True
    assert_all_blocks_free(llm)


def test_the_disk_tier_is_emptied_only_with_reset_connector(checkpoint, tmp_path) -> None:
    prompts = _prompts(2)
    llm = _llm(checkpoint, kv_offload_dir=str(tmp_path))
    expected = greedy_token_ids(llm, prompts[:1], MAX_NEW)
    llm.engine.flush_kv_offload()
    num_files = llm.stats()["kv_offload_disk_blocks"]
    assert num_files > 0 and len(list(tmp_path.rglob("*.kvb"))) == num_files

    assert llm.reset_prefix_cache() is True  # the device's cache only: the next run finds the tiers' blocks
    assert greedy_token_ids(llm, prompts[:1], MAX_NEW) == expected
    hits = _tier_hits(llm)
    assert hits > 0 and llm.stats()["kv_offload_disk_blocks"] == num_files

    assert llm.reset_prefix_cache(reset_connector=True) is True
    assert llm.stats()["kv_offload_disk_blocks"] == 0 and llm.stats()["kv_offload_host_blocks"] == 0
    deadline = time.monotonic() + 10  # the writer thread removes the files
    while list(tmp_path.rglob("*.kvb")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not list(tmp_path.rglob("*.kvb"))
    assert greedy_token_ids(llm, prompts[:1], MAX_NEW) == expected
    assert _tier_hits(llm) == hits  # nothing found: recomputed
    assert_all_blocks_free(llm)
    _check_integrity(llm.engine)
