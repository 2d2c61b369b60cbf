"""``--preemption-mode swap`` through the whole engine: with a device pool too small for the batch, requests
preempted by swap resume from their KV loaded back from the host tier and give the same greedy tokens as a
large pool and as recompute, for fp32 and int8 KV, n = 1 and 2, prefix caching on and off; the counters say
the swaps happened, and no token ran through the model twice."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free, greedy_token_ids

MAX_NEW = 12
SMALL_POOL = {"num_kv_blocks": 16, "max_num_seqs": 4, "block_size": 4}
_expected: dict[tuple[str, int], tuple[list, int]] = {}  # (kv dtype, n) -> (tokens, tokens scheduled), large pool


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randrange(9, 19))] for _ in range(6)]


def _llm(path: Path, **options) -> LLM:
    return LLM(str(path), dtype="float32", **options)


def _num_tokens_computed(llm: LLM) -> int:
    return llm.stats()["num_tokens_computed"]


def _large_pool(path: Path, kv_cache_dtype: str, n: int) -> tuple[list, int]:
    if (kv_cache_dtype, n) not in _expected:
        llm = _llm(path, kv_cache_dtype=kv_cache_dtype, num_kv_blocks=256, block_size=4)
        _expected[kv_cache_dtype, n] = greedy_token_ids(llm, _prompts(), MAX_NEW, n=n), _num_tokens_computed(llm)
    return _expected[kv_cache_dtype, n]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_swap_matches_a_large_pool_and_recompute_and_computes_nothing_twice(
    tiny_checkpoints, kv_cache_dtype: str, prefix_caching: bool, n: int
) -> None:
    path = tiny_checkpoints["llama"]
    expected, num_scheduled = _large_pool(path, kv_cache_dtype, n)
    options = {**SMALL_POOL, "kv_cache_dtype": kv_cache_dtype, "enable_prefix_caching": prefix_caching}
    recompute = _llm(path, **options)
    assert greedy_token_ids(recompute, _prompts(), MAX_NEW, n=n) == expected
    swap = _llm(path, preemption_mode="swap", kv_offload_memory=0.01, **options)
    assert greedy_token_ids(swap, _prompts(), MAX_NEW, n=n) == expected
    stats = swap.stats()
    assert stats["preemption_mode"] == "swap" and stats["num_preemptions"] > 0, stats
    assert stats["num_swapped_out"] == stats["num_swapped_in"] >= stats["num_preemptions"], stats
    num_restored = stats["num_blocks_swapped_in"] + stats["num_blocks_swap_in_found_on_device"]
    assert num_restored == stats["num_blocks_swapped_out"] > 0, stats
    if not prefix_caching:
        assert stats["num_blocks_swap_in_found_on_device"] == 0, stats
    assert stats["num_swap_fallbacks"] == 0, stats
    assert _num_tokens_computed(swap) == num_scheduled < _num_tokens_computed(recompute), "a token ran twice"
    assert_all_blocks_free(swap)
    assert recompute.stats()["num_swapped_out"] == 0


def test_a_host_tier_too_small_falls_back_to_recompute(tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama"]
    expected, _ = _large_pool(path, "auto", 1)
    bytes_per_block = LLM(str(path), dtype="float32", num_kv_blocks=1).engine.core.runner.kv_bytes_per_block()
    llm = _llm(path, preemption_mode="swap", kv_offload_memory=bytes_per_block / 2**30, **SMALL_POOL)
    assert greedy_token_ids(llm, _prompts(), MAX_NEW) == expected  # one host row: only a one-block KV fits
    stats = llm.stats()
    assert stats["num_swap_fallbacks"] > 0, stats
    assert stats["num_swap_fallbacks"] + stats["num_swapped_out"] == stats["num_preemptions"], stats
    assert_all_blocks_free(llm)


def test_aborting_requests_while_swapped_out_gives_every_host_row_back(tiny_checkpoints) -> None:
    llm = _llm(tiny_checkpoints["llama"], preemption_mode="swap", kv_offload_memory=0.01, **SMALL_POOL)
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=MAX_NEW)
    for index, prompt in enumerate(_prompts()):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)
    while not any(engine.core.kv_manager.is_swapped_out(r) for r in engine.core.scheduler.requests.values()):
        engine.step()
    engine.abort_request([f"r{index}" for index in range(len(_prompts()))])
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)
    host = engine.core.kv_manager.store.host
    assert len(host._free) + host.num_blocks == host.num_rows, "swapped-out rows outlived their requests"
