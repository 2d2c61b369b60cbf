"""Greedy token-exact agreement with transformers (fp32, CPU) through the whole engine, for every family:
alone, batched with mixed lengths, with chunked prefill forced small, with n > 1, and under preemption."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM
from kvserve.model.checkpoint import ARCHITECTURES
from tests.conftest import assert_all_blocks_free, greedy_token_ids, hf_greedy

MAX_NEW = 12


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def family(request: pytest.FixtureRequest, tiny_checkpoints):
    path = tiny_checkpoints[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, [5, 40, 17, 1, 33, 9])
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return path, prompts, expected


def _generate(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    return greedy_token_ids(llm, prompts, MAX_NEW, n)


def test_alone(family) -> None:
    path, prompts, expected = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    for prompt, want in zip(prompts, expected):
        assert _generate(llm, [prompt])[0][0] == want
    assert_all_blocks_free(llm)


def test_batched_with_mixed_lengths(family) -> None:
    path, prompts, expected = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert [o[0] for o in _generate(llm, prompts)] == expected
    assert_all_blocks_free(llm)


def test_chunked_prefill_with_an_8_token_budget(family) -> None:
    path, prompts, expected = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8)
    assert [o[0] for o in _generate(llm, prompts)] == expected
    assert_all_blocks_free(llm)


def test_n_samples_share_the_prompt(family) -> None:
    path, prompts, expected = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    for samples, want in zip(_generate(llm, prompts, n=3), expected):
        assert samples == [want] * 3
    assert_all_blocks_free(llm)


def test_preemption_under_a_small_kv_cache(family) -> None:
    path, prompts, expected = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=14, block_size=4, max_num_batched_tokens=16)
    assert [o[0] for o in _generate(llm, prompts)] == expected
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)
