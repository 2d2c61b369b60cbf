"""The engine on a quantized KV cache: chunked prefill, n > 1, prefix hits and preemption give the tokens of a
plain run on the same encoding; the budget holds proportionally more blocks; and, on the real SmolLM2 and Gemma 3,
int8 and fp8 keep logits and greedy tokens close to the fp32 cache (int4 within its own, looser bound)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.backend import AttentionInputs
from kvserve.bench.datasets import SHAREGPT_SAMPLE
from kvserve.kv.quant import ENCODINGS
from kvserve.kv.storage import KVCacheStorage
from kvserve.model.checkpoint import make_checkpoint
from tests.conftest import assert_all_blocks_free, greedy_token_ids

MAX_NEW = 12
ENCODING_NAMES = list(ENCODINGS)


@pytest.fixture(scope="module")
def llama(tiny_checkpoints) -> tuple[str, list[list[int]]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 40, 17, 1, 33, 9)]
    return str(tiny_checkpoints["llama"]), prompts


def baseline(path: str, prompts: list[list[int]], kv_cache_dtype: str) -> list[list[int]]:
    """The prompts' greedy tokens in one batch, which each prompt alone must equal: with fp32 weights (the dense
    panels, summed in one order whatever the step's rows) a quantized cache's codes do not depend on the batch
    either. (The GGUF block kernels sum a row in an order that depends on how many rows share its tile, and a
    quantized cache can then round a key the other way: README, "Quantized GGUF weights".)"""
    llm = LLM(path, dtype="float32", num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    assert llm.stats()["kv_cache_dtype"] == kv_cache_dtype
    batched = [o[0] for o in greedy_token_ids(llm, prompts, MAX_NEW)]
    assert [greedy_token_ids(llm, [prompt], MAX_NEW)[0][0] for prompt in prompts] == batched
    return batched


@pytest.mark.parametrize("kv_cache_dtype", ENCODING_NAMES)
def test_chunks_samples_prefix_hits_and_preemption_keep_the_tokens(llama, kv_cache_dtype: str) -> None:
    path, prompts = llama
    expected = baseline(path, prompts, kv_cache_dtype)

    chunked = LLM(path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8, kv_cache_dtype=kv_cache_dtype)
    assert [o[0] for o in greedy_token_ids(chunked, prompts, MAX_NEW)] == expected
    assert [o[0] for o in greedy_token_ids(chunked, prompts, MAX_NEW)] == expected  # now from the prefix cache
    assert chunked.stats()["prefix_cache_hits"] > 0
    assert_all_blocks_free(chunked)

    samples = LLM(path, dtype="float32", num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    assert greedy_token_ids(samples, prompts, MAX_NEW, n=3) == [[want] * 3 for want in expected]
    assert_all_blocks_free(samples)

    small = LLM(path, dtype="float32", num_kv_blocks=14, block_size=4, max_num_batched_tokens=16,
                kv_cache_dtype=kv_cache_dtype)
    assert [o[0] for o in greedy_token_ids(small, prompts, MAX_NEW)] == expected
    assert small.stats()["num_preemptions"] > 0
    assert_all_blocks_free(small)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_windowed_models_logprobs_are_the_same_bits_wherever_its_chunks_are_cut(tmp_path: Path,
                                                                                   kv_cache_dtype: str) -> None:
    """Gemma 3's window layers (64 keys: more than one tile of the kernel's): a chunk's first query sets where its
    keys start, so key tiles on a grid of their own keep each row's sums (and a quantized cache's codes) the same
    whatever the budget cut the prompt into, so in any batch (none of these budgets leaves a last chunk of one
    token, which the decode kernel would take)."""
    path = make_checkpoint(tmp_path / "gemma3", "gemma3", "small", seed=0)
    rng = random.Random(1)
    prompt = [rng.randrange(3, 2000) for _ in range(301)]
    logprobs = []
    for budget in (7, 16, 64):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=budget,
                  kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
        output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                              use_tqdm=False)[0].outputs[0]
        logprobs.append([{token: entry.logprob for token, entry in position.items()} for position in output.logprobs])
    assert logprobs[0] == logprobs[1] == logprobs[2]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", *ENCODING_NAMES])
def test_requests_on_one_system_prompt_get_the_logprobs_they_get_alone(llama, kv_cache_dtype: str) -> None:
    """Decodes that share a system prompt's blocks through the prefix cache (and the samples of n > 1) are
    attended as a group over those blocks, with the very sums each gets alone: their logprobs are the same bits
    batched or alone, with every KV encoding. (An n > 1 request is compared with itself alone, not with n = 1:
    it decodes its last prompt token, which n = 1 prefills, README.)"""
    path, prompts = llama
    system = [(7 * i) % 190 + 3 for i in range(70)]  # four whole blocks: two whole tiles of the decode kernel
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=2)

    def logprobs(outputs) -> list[list[list[dict[int, float]]]]:
        return [[[{t: e.logprob for t, e in position.items()} for position in sample.logprobs]
                 for sample in output.outputs] for output in outputs]

    llm = LLM(path, dtype="float32", num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype)
    requests = [{"prompt_token_ids": system + prompt} for prompt in prompts]
    batched = logprobs(llm.generate(requests, params, use_tqdm=False))
    assert llm.stats()["prefix_cache_hits"] > 0
    alone = [logprobs(llm.generate([request], params, use_tqdm=False))[0] for request in requests]
    assert alone == batched
    three = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=2, n=3)
    samples = logprobs(llm.generate(requests[:3], three, use_tqdm=False))
    assert [logprobs(llm.generate([request], three, use_tqdm=False))[0] for request in requests[:3]] == samples
    assert all(request_samples == [request_samples[0]] * 3 for request_samples in samples)
    assert_all_blocks_free(llm)


def test_the_same_budget_holds_proportionally_more_blocks(llama) -> None:
    path, _ = llama
    budget_gib = 2**-10
    blocks = {name: LLM(path, dtype="float32", kv_cache_memory=budget_gib, kv_cache_dtype=name).stats()
              for name in ("auto", *ENCODING_NAMES)}
    for name in ENCODING_NAMES:
        assert blocks[name]["kv_cache_bytes"] <= budget_gib * 2**30
        ratio = blocks[name]["num_blocks_total"] / blocks["auto"]["num_blocks_total"]
        head_dim = 16  # the tiny model's: int8 3.6x, int4 5.3x (SmolLM2's 64: 3.9x, 7.1x)
        expected = 4 * head_dim / ENCODINGS[name].bytes_per_token_head(head_dim)
        assert ratio == pytest.approx(expected, rel=0.05), (name, ratio)


# --- the real default model ---------------------------------------------------------------------------------------

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based inks and a wooden press adapted from those used to make wine. Within a few "
          "decades printing shops had spread across Europe, and the price of books fell")
# Per model and encoding, against the fp32 cache over every prompt position: the max and mean |logit error|, the
# greedy tokens that must agree (of 32), and the fraction of prompt positions whose argmax must not change.
# Measured on AMD EPYC Zen 2 (AVX2), session 8 (max / mean, greedy agreeing, argmax kept):
#   SmolLM2  int8 0.57 / 0.069, 32, 100%;  fp8 1.62 / 0.177, 32, 94%
#   Gemma 3  int8 1.29 / 0.143, 18, 91%;   fp8 0.98 / 0.100, 14, 96%
# int4 on Intel Xeon (Emerald Rapids), session 20, since it takes groups of at most 64 values and stores keys
# rotated (kv/quant.py): SmolLM2 4.2 / 0.68, 10, 83%; Gemma 3 5.1 / 0.65, 0, 82% (before, with one group a
# row and keys as they are: SmolLM2 8.1 / 1.22, 0, 72%; Gemma 3 31.7 / 3.01, 0, 43%). A code flips where a
# value near a rounding boundary moves by an ulp, so int4's figures move with the order of the arithmetic
# (the same cache with the queries rotated by a torch matmul instead: Gemma 3 6.7 / 0.66, 2, 83%); with a
# sixth of the positions changing their argmax, Gemma 3's first greedy token is a coin toss and is not held to
# agree. The bounds leave room for other CPUs' rounding. They are this 53-token prompt's: the max error grows with
# the number of positions (1.6 / 4.4 / 12.0 for SmolLM2 at 1,024 tokens), the mean a little; the test below holds
# a long text to bounds of its own.
BOUNDS = {
    ("smollm2-135m-instruct", "int8"): (1.0, 0.12, 16, 0.97),
    ("smollm2-135m-instruct", "fp8"): (2.5, 0.3, 16, 0.88),
    ("smollm2-135m-instruct", "int4"): (7.0, 1.0, 4, 0.8),
    ("gemma-3-270m", "int8"): (2.5, 0.25, 8, 0.85),
    ("gemma-3-270m", "fp8"): (2.0, 0.2, 8, 0.9),
    ("gemma-3-270m", "int4"): (10.0, 1.0, 0, 0.75),
}


LONG_TOKENS = 1024
# Per model and encoding, over the first 1,024 tokens of kvserve's ShareGPT sample text in one prefill (past Gemma
# 3's 512-token window), against the fp32 cache at every position: the mean |logit error|, the mean KL divergence
# of the quantized distribution from the fp32 one, and the fraction of positions whose argmax must not change.
# Measured on AMD EPYC Zen 5, session 36 (mean error, mean KL, argmax kept):
#   SmolLM2  int8 0.113, 5.2e-4, 99.2%;  fp8 0.275, 3.2e-3, 98.9%;  int4 0.955, 3.9e-2, 94.4%
#   Gemma 3  int8 0.167, 3.3e-3, 98.7%;  fp8 0.154, 2.9e-3, 99.0%;  int4 0.910, 8.8e-2, 93.5%
# The bounds allow ~1.5x the mean error and ~2x the KL, so that a 2x regression fails; the max error is not bounded
# here (it grows with the positions counted). They are this text's: other texts move more. Gemma 3 on 2,500 tokens of
# the MPL-2.0 licence (session 38's audit): int8 0.172, 6.3e-3, 95.9%; fp8 0.166, 7.3e-3, 96.0%; int4 0.900, 1.5e-1,
# 81.1% (its first 1,024 tokens alike), so what int4 keeps of a long text's argmaxes ranges from ~80% to ~94%.
LONG_BOUNDS = {
    ("smollm2-135m-instruct", "int8"): (0.16, 1e-3, 0.97),
    ("smollm2-135m-instruct", "fp8"): (0.4, 6e-3, 0.96),
    ("smollm2-135m-instruct", "int4"): (1.4, 0.08, 0.9),
    ("gemma-3-270m", "int8"): (0.25, 6e-3, 0.96),
    ("gemma-3-270m", "fp8"): (0.23, 6e-3, 0.96),
    ("gemma-3-270m", "int4"): (1.3, 0.18, 0.88),
}


def long_text_ids(tokenizer) -> list[int]:
    conversations = json.loads(SHAREGPT_SAMPLE.read_text())
    text = "\n\n".join(turn["value"] for conversation in conversations for turn in conversation["conversations"])
    return tokenizer.encode(text)[:LONG_TOKENS]


def prompt_logits(runner, token_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, computed through the runner's model and a fresh cache of its encoding."""
    spec = runner.kv_cache_spec()
    kv = KVCacheStorage(spec, -(-len(token_ids) // spec.block_size), "cpu")
    n = len(token_ids)
    inputs = AttentionInputs(
        num_decodes=0, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(kv.num_blocks, dtype=torch.int32).unsqueeze(0),
        slot_mapping=torch.arange(n), query_lens_list=[n], seq_lens_list=[n], block_size=spec.block_size,
    )
    meta = runner.backend.build_metadata(inputs, runner.model.sliding_windows())
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(token_ids), torch.arange(n), meta, kv)
        return runner.model.compute_logits(hidden)


@pytest.mark.slow
@pytest.mark.parametrize("model, kv_cache_dtype", list(BOUNDS))
def test_real_models_logits_and_greedy_tokens_stay_close_to_the_fp32_cache(model: str, kv_cache_dtype: str) -> None:
    max_bound, mean_bound, num_agree, argmax_kept = BOUNDS[model, kv_cache_dtype]
    plain = LLM(model, dtype="float32", max_model_len=512)
    quantized = LLM(model, dtype="float32", max_model_len=512, kv_cache_dtype=kv_cache_dtype)
    token_ids = plain.get_tokenizer().encode(PROMPT)
    reference = prompt_logits(plain.engine.core.runner, token_ids)
    logits = prompt_logits(quantized.engine.core.runner, token_ids)
    error = (logits - reference).abs()
    kept = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"{model} {kv_cache_dtype}: max |logit error| {error.max():.3f}, mean {error.mean():.4f}, argmax kept {kept:.1%}")
    assert error.max() < max_bound and error.mean() < mean_bound and kept >= argmax_kept
    want, got = (greedy_token_ids(llm, [token_ids], 32)[0][0] for llm in (plain, quantized))
    assert got[:num_agree] == want[:num_agree]


@pytest.mark.parametrize("model, kv_cache_dtype", [
    pytest.param(model, encoding, marks=[pytest.mark.slow] if model == "gemma-3-270m" else [])
    for model, encoding in LONG_BOUNDS
])
def test_real_models_logits_over_a_long_text_stay_close_to_the_fp32_cache(model: str, kv_cache_dtype: str) -> None:
    mean_bound, kl_bound, argmax_kept = LONG_BOUNDS[model, kv_cache_dtype]
    plain = LLM(model, dtype="float32", max_model_len=LONG_TOKENS, num_kv_blocks=LONG_TOKENS // 16)
    token_ids = long_text_ids(plain.get_tokenizer())
    assert len(token_ids) == LONG_TOKENS
    reference = prompt_logits(plain.engine.core.runner, token_ids)
    del plain
    quantized = LLM(model, dtype="float32", max_model_len=LONG_TOKENS, num_kv_blocks=LONG_TOKENS // 16,
                    kv_cache_dtype=kv_cache_dtype)
    logits = prompt_logits(quantized.engine.core.runner, token_ids)
    error = (logits - reference).abs().mean().item()
    reference_logprobs, logprobs = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (reference_logprobs.exp() * (reference_logprobs - logprobs)).sum(-1).mean().item()
    kept = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"{model} {kv_cache_dtype} over {LONG_TOKENS} tokens: mean |logit error| {error:.4f}, mean KL {kl:.2e}, "
          f"argmax kept {kept:.1%}")
    assert error < mean_bound and kl < kl_bound and kept >= argmax_kept


@pytest.mark.parametrize("kv_cache_dtype, bound", [("int8", 0.12), ("int4", 0.47)])
def test_a_decoded_tokens_logprob_stays_within_the_stated_bound_of_the_same_text_scored_as_a_prompt(
    kv_cache_dtype: str, bound: float
) -> None:
    """README: decode steps write K/V through the decode kernel's sums where a prefill writes them through the
    prefill kernel's, so on a quantized cache a key can round to another code: on SmolLM2 a decoded token's
    logprob against the same text scored as a prompt differed by up to 0.12 with int8 and 0.47 with int4."""
    llm = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=LONG_TOKENS, kv_cache_dtype=kv_cache_dtype,
              enable_prefix_caching=False)
    prompt = long_text_ids(llm.get_tokenizer())[:300]
    decoded = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=32, logprobs=0, ignore_eos=True), use_tqdm=False)
    sample = decoded[0].outputs[0]
    scored = llm.generate([{"prompt_token_ids": prompt + list(sample.token_ids)}],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    as_prompt = scored[0].prompt_logprobs[len(prompt):]
    drift = [abs(d[t].logprob - p[t].logprob) for t, d, p in zip(sample.token_ids, sample.logprobs, as_prompt)]
    print(f"{kv_cache_dtype}: max {max(drift):.4f}, mean {sum(drift) / len(drift):.4f}")
    assert len(drift) == 32 and max(drift) < bound
