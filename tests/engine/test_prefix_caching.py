"""Prefix caching through the whole engine: outputs are token-identical with the cache on and off (and equal
transformers' greedy), for shared system prompts, multi-turn histories, n > 1, preemption under a small KV
cache, aborts in the middle and random interleavings; every block is free at the end."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free, greedy_token_ids, hf_greedy

MAX_NEW = 8
NEW_USER_TOKENS = 5
FAMILIES = ["llama", "gemma3"]  # gemma3: sliding-window layers read reused blocks too


def _shared_prefix_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """3 system prompts of 20-44 tokens, each followed by 3 different user suffixes of 1-9 tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(3):
        system = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(20, 45))]
        prompts += [system + [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 10))] for _ in range(3)]
    return prompts


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tiny_checkpoints):
    path = tiny_checkpoints[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _shared_prefix_prompts(hf.config.vocab_size)
    return path, hf, prompts


def _llm(path, caching: bool, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 128)
    kwargs.setdefault("block_size", 4)
    return LLM(str(path), dtype="float32", enable_prefix_caching=caching, **kwargs)


def _generate(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    return greedy_token_ids(llm, prompts, MAX_NEW, n)


def test_shared_system_prompts_match_cache_off_and_transformers(family) -> None:
    path, hf, prompts = family
    on, off = _llm(path, True), _llm(path, False)
    got = _generate(on, prompts)
    assert got == _generate(off, prompts)
    assert [g[0] for g in got] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    stats = on.stats()
    assert stats["prefix_cache_hits"] >= 6 * 20 // 4 * 4  # 2 of each 3 siblings reuse >= 20 tokens' blocks
    assert off.stats()["prefix_cache_hits"] == 0
    assert_all_blocks_free(on)


def test_a_multi_turn_history_is_reused(family) -> None:
    path, hf, prompts = family
    on, off = _llm(path, True), _llm(path, False)
    history = prompts[0]
    for turn in range(3):
        want = _generate(off, [history])[0][0]
        out = on.generate([{"prompt_token_ids": history}], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                          use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        if turn:  # the previous turn's prompt and answer but the answer's last token, in whole blocks
            assert out.num_cached_tokens == (len(history) - NEW_USER_TOKENS - 1) // 4 * 4
        history = history + want + prompts[turn + 1][-NEW_USER_TOKENS:]
    assert_all_blocks_free(on)


def test_n_samples_with_shared_prefixes(family) -> None:
    path, _, prompts = family
    on = _llm(path, True)
    assert _generate(on, prompts, n=3) == _generate(_llm(path, False), prompts, n=3)
    # shared blocks count once: with 4-token blocks, at most 3 of 4 slots idle per sequence's last block
    assert 0 <= on.stats()["kv_waste_at_peak"] < 0.5


def test_preemption_under_a_small_kv_cache(family) -> None:
    path, _, prompts = family
    small = dict(num_kv_blocks=24, max_num_batched_tokens=16)
    on = _llm(path, True, **small)
    assert _generate(on, prompts) == _generate(_llm(path, False, **small), prompts)
    assert on.stats()["num_preemptions"] > 0
    assert_all_blocks_free(on)


def test_an_eviction_heavy_run_stays_exact(family) -> None:
    path, _, prompts = family
    on = _llm(path, True, num_kv_blocks=40, max_num_seqs=2)
    assert _generate(on, prompts) == _generate(_llm(path, False, num_kv_blocks=40, max_num_seqs=2), prompts)
    assert on.stats()["prefix_cache_evictions"] > 0
    assert_all_blocks_free(on)


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _shared_prefix_prompts(hf.config.vocab_size, seed=1)
    reference = [g[0] for g in _generate(_llm(path, False), prompts)]
    return _llm(path, True, num_kv_blocks=48, max_num_batched_tokens=16), prompts, reference


@settings(max_examples=12, deadline=None)
@given(
    arrivals=st.lists(st.integers(0, 6), min_size=9, max_size=9),
    aborts=st.lists(st.none() | st.integers(1, 8), min_size=9, max_size=9),
)
def test_random_interleavings_and_aborts(llama, arrivals: list[int], aborts: list[int | None]) -> None:
    """Requests arrive at random steps and some are aborted mid-way, on one long-lived cached engine: every
    request that finishes has exactly the cache-off tokens, and no block is leaked."""
    llm, prompts, reference = llama
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    finished: dict[str, list[int]] = {}
    for step in range(200):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                engine.add_request(f"q{i}", {"prompt_token_ids": prompts[i]}, params)
        engine.abort_request([f"q{i}" for i, a in enumerate(aborts) if a is not None and arrivals[i] + a == step])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if step > max(arrivals) and not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    for request_id, tokens in finished.items():
        i = int(request_id[1:])
        assert tokens == reference[i][: len(tokens)]
        if aborts[i] is None:
            assert tokens == reference[i]
    assert_all_blocks_free(llm)
    engine.core.kv_manager.check_integrity([])


def test_a_cache_salt_keeps_requests_of_other_salts_from_its_blocks(family) -> None:
    """vLLM's ``cache_salt``: the same prompt under another salt (or none) computes its prefix again, under the
    same salt it hits; the answers are the same either way."""
    path, hf, prompts = family
    on = _llm(path, True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)

    def cached(salt: str | None) -> tuple[int, list[int]]:
        prompt = {"prompt_token_ids": prompts[0]} | ({"cache_salt": salt} if salt else {})
        out = on.generate([prompt], params, use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    want = hf_greedy(hf, prompts[0], MAX_NEW)
    hit = (len(prompts[0]) - 1) // 4 * 4
    assert [cached(salt) for salt in ["tenant-1", "tenant-1", "tenant-2", None, None, "tenant-2"]] == [
        (0, want), (hit, want), (0, want), (0, want), (hit, want), (hit, want)]
    assert_all_blocks_free(on)
