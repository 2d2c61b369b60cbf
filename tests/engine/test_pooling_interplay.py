"""Pooling requests against the engine's other features and options, pair by pair: quantized KV (within a stated
bound), the KV tiers, swap under memory pressure, sliding windows, prefix-cache and block-size settings, one-token
chunks through step graphs, cache salts, LoRA adapters, speculation, scheduling policies, weight quantization and
GGUF, mmap loading, aborts and failed steps. Every embedding is held to transformers' ``last_hidden_state`` (fp32),
every engine left with no block used and no pooler state."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.engine_args import EngineArgs
from kvserve.model.lora_checkpoint import make_lora_adapter
from kvserve.pooling_params import PoolingParams
from tests.conftest import assert_all_blocks_free
from tests.engine.test_lora import merged_transformers

ATOL = 1e-4  # fp32: the engine's kernels sum in another order than transformers' ops
# 1 - cosine similarity of a unit embedding to transformers' over a quantized KV cache (README's pooling section):
# measured at most 4.6e-4 (int8), 1.1e-2 (fp8), 6.7e-2 (int4) over the tiny Llama and Gemma 3, LAST / MEAN / CLS
KV_COSINE_BOUND = {"int8": 1e-3, "fp8": 2.5e-2, "int4": 0.15}


def _prompts(lengths: list[int], seed: int = 0, vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    """transformers' final hidden states (fp32) of a prompt, by family."""
    models = {}

    def hidden(family: str, prompt: list[int], path: Path | None = None) -> torch.Tensor:
        key = path or tiny_checkpoints[family]
        if key not in models:
            models[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        with torch.no_grad():
            return models[key].model(torch.tensor([prompt])).last_hidden_state[0]
    return hidden


def _pooled(states: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": states[-1], "MEAN": states.mean(dim=0), "CLS": states[0]}[pooling_type]


def _encode(llm: LLM, prompts: list[list[int]], task: str = "embed", **kwargs) -> list[torch.Tensor]:
    params = PoolingParams(task=task, normalize=False)
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kwargs)
    return [out.outputs.data for out in outs]


def _run(llm: LLM) -> dict:
    finished = {}
    while llm.engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in llm.engine.step() if out.finished)
    return finished


def _assert_clean(llm: LLM) -> None:
    assert_all_blocks_free(llm)
    assert not llm.engine.core.runner.pooler._parts


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_quantized_kv_embeddings_stay_within_their_bound_and_a_prefix_hit_keeps_them(
        tiny_checkpoints, reference, family, kv_cache_dtype) -> None:
    prompts = _prompts([5, 40, 17, 1, 33], seed=11)
    for pooling_type in ("LAST", "MEAN"):
        llm = LLM(str(tiny_checkpoints[family]), dtype="float32", num_kv_blocks=64, block_size=4,
                  max_num_batched_tokens=8, kv_cache_dtype=kv_cache_dtype, pooler_config={"pooling_type": pooling_type})
        first = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        again = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        distances = []
        for out, prompt in zip(first, prompts):
            want = torch.nn.functional.normalize(_pooled(reference(family, prompt), pooling_type), dim=-1)
            distances.append(1 - torch.dot(out.outputs.data, want).item())
        assert 1e-7 < max(distances) < KV_COSINE_BOUND[kv_cache_dtype], distances  # quantized, within the bound
        # LAST starts from the quantized prefix it left (MEAN from none): the same vector as the first time
        assert [o.num_cached_tokens > 0 for o in again] == [pooling_type == "LAST" and len(p) > 4 for p in prompts]
        for a, b in zip(first, again):
            torch.testing.assert_close(b.outputs.data, a.outputs.data, atol=1e-5, rtol=0)
        _assert_clean(llm)


def test_a_last_embedding_whose_prefix_comes_back_from_the_host_or_disk_tier(tiny_checkpoints, reference,
                                                                              tmp_path) -> None:
    path = str(tiny_checkpoints["llama"])
    prompt, others = _prompts([40], seed=7)[0], _prompts([40, 40, 40], seed=8)
    small_pool = dict(dtype="float32", num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    host = LLM(path, kv_offload_memory=0.01, **small_pool)
    _encode(host, [prompt])
    _encode(host, others)  # evicts the prompt's blocks from the device pool into the host tier
    torch.testing.assert_close(_encode(host, [prompt])[0], reference("llama", prompt)[-1], atol=ATOL, rtol=0)
    assert host.stats()["kv_offload_host_hit_tokens"] == 36
    _assert_clean(host)
    writer = LLM(path, kv_offload_dir=str(tmp_path), **small_pool)
    _encode(writer, [prompt])
    writer.engine.flush_kv_offload()
    reader = LLM(path, kv_offload_dir=str(tmp_path), **small_pool)
    torch.testing.assert_close(_encode(reader, [prompt])[0], reference("llama", prompt)[-1], atol=ATOL, rtol=0)
    assert reader.stats()["kv_offload_disk_hit_tokens"] == 36
    _assert_clean(reader)


@pytest.mark.parametrize("task, pooling_type", [("embed", "MEAN"), ("embed", "CLS"), ("token_embed", "LAST")])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_swap_under_memory_pressure_keeps_every_pooling_request_exact(tiny_checkpoints, reference, family, task,
                                                                       pooling_type) -> None:
    """Six pooling requests beside six generations in a 24-block pool: several are swapped out mid-prompt and
    resume where they stopped, the pooler's chunks kept; Gemma 3's window layers drop blocks meanwhile."""
    prompts = _prompts([40, 33, 29, 38, 21, 35], seed=3)
    llm = LLM(str(tiny_checkpoints[family]), dtype="float32", num_kv_blocks=24, block_size=4,
              max_num_batched_tokens=16, preemption_mode="swap", kv_offload_memory=0.01,
              pooler_config={"pooling_type": pooling_type})
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"gen-{i}", {"prompt_token_ids": prompt[:10]},
                               SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        llm.engine.add_request(f"pool-{i}", {"prompt_token_ids": prompt}, PoolingParams(task=task, normalize=False))
    finished = _run(llm)
    stats = llm.stats()
    assert stats["num_swapped_out"] >= 3 and stats["num_swapped_in"] == stats["num_swapped_out"]
    assert stats["num_swap_fallbacks"] == 0
    for i, prompt in enumerate(prompts):
        states = reference(family, prompt)
        want = states if task == "token_embed" else _pooled(states, pooling_type)
        torch.testing.assert_close(finished[f"pool-{i}"].outputs.data, want, atol=ATOL, rtol=0)
    _assert_clean(llm)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_sliding_window_prompts_past_the_window_in_chunks(tiny_checkpoints, reference, pooling_type) -> None:
    """Gemma 3's window (12 tokens) crossed in 8-token chunks; a LAST embedding then starts from the prefix a
    generation left (the window layers' blocks of it partly gone), the others from none."""
    prompts = _prompts([50, 13, 37, 64, 1])
    llm = LLM(str(tiny_checkpoints["gemma3"]), dtype="float32", num_kv_blocks=128, block_size=4,
              max_num_batched_tokens=8, pooler_config={"pooling_type": pooling_type})
    for got, prompt in zip(_encode(llm, prompts, "token_embed"), prompts):
        torch.testing.assert_close(got, reference("gemma3", prompt), atol=ATOL, rtol=0)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=3, temperature=0),
                 use_tqdm=False)
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False), use_tqdm=False)
    for out, prompt in zip(outs, prompts):
        torch.testing.assert_close(out.outputs.data, _pooled(reference("gemma3", prompt), pooling_type),
                                   atol=ATOL, rtol=0)
    assert [out.num_cached_tokens for out in outs] == ([48, 12, 36, 60, 0] if pooling_type == "LAST" else [0] * 5)
    _assert_clean(llm)


@pytest.mark.parametrize("options, cached", [
    ({"enable_prefix_caching": False}, [0, 0, 0]),
    ({"block_size": 1}, [4, 39, 16]),
    ({"block_size": 32}, [0, 32, 0]),
])
def test_prefix_cache_settings_decide_what_a_last_embedding_reuses(tiny_checkpoints, reference, options,
                                                                    cached) -> None:
    prompts = _prompts([5, 40, 17])
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=8, **options)
    _encode(llm, prompts)
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False), use_tqdm=False)
    assert [out.num_cached_tokens for out in outs] == cached
    for out, prompt in zip(outs, prompts):
        torch.testing.assert_close(out.outputs.data, reference("llama", prompt)[-1], atol=ATOL, rtol=0)
    _assert_clean(llm)


@pytest.mark.parametrize("max_num_batched_tokens", [1, 2])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_one_and_two_token_chunks_through_step_graphs_or_eagerly(tiny_checkpoints, reference, max_num_batched_tokens,
                                                                 enforce_eager) -> None:
    """A one-token chunk is a decode-shaped step, which a CPU step graph replays into a buffer the next step
    overwrites: the pooler's chunks are copies."""
    prompts = _prompts([5, 12, 1])
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, enforce_eager=enforce_eager,
              max_num_batched_tokens=max_num_batched_tokens, pooler_config={"pooling_type": "MEAN"})
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"mean-{i}", {"prompt_token_ids": prompt}, PoolingParams(normalize=False))
        llm.engine.add_request(f"rows-{i}", {"prompt_token_ids": prompt},
                               PoolingParams(task="token_embed", normalize=False))
    finished = _run(llm)
    assert (llm.stats()["num_graph_replays"] > 0) is not enforce_eager
    for i, prompt in enumerate(prompts):
        states = reference("llama", prompt)
        torch.testing.assert_close(finished[f"mean-{i}"].outputs.data, states.mean(dim=0), atol=ATOL, rtol=0)
        torch.testing.assert_close(finished[f"rows-{i}"].outputs.data, states, atol=ATOL, rtol=0)
    _assert_clean(llm)


def test_cache_salt_separates_pooled_prefixes(tiny_checkpoints) -> None:
    prompt = _prompts([40])[0]
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, block_size=8)
    salted = [llm.encode({"prompt_token_ids": prompt, "cache_salt": salt}, use_tqdm=False)[0] for salt in "ab"]
    plain = llm.encode({"prompt_token_ids": prompt}, use_tqdm=False)[0]
    assert [o.num_cached_tokens for o in (*salted, plain)] == [0, 0, 0]
    llm.engine.add_request("again", {"prompt_token_ids": prompt, "cache_salt": "a"}, PoolingParams())
    again = _run(llm)["again"]
    assert again.num_cached_tokens == 32
    torch.testing.assert_close(again.outputs.data, salted[0].outputs.data, atol=ATOL, rtol=0)
    _assert_clean(llm)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_a_lora_embedding_is_the_merged_models(tiny_checkpoints, reference, tmp_path, pooling_type) -> None:
    base = tiny_checkpoints["llama"]
    adapter = make_lora_adapter(base, tmp_path / "adapter", rank=8, seed=1)
    merged = merged_transformers(base, adapter)
    lora = LoRARequest("adapter", 1, str(adapter))
    prompts = _prompts([5, 40, 17, 1])
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, enable_lora=True,
              pooler_config={"pooling_type": pooling_type})
    adapters = [lora, None, lora, lora]
    for _ in range(2):  # the second time, a LAST embedding starts from its own adapter's cached prefix
        got = _encode(llm, prompts, lora_request=adapters)
        for vector, prompt, adapter_used in zip(got, prompts, adapters):
            with torch.no_grad():
                merged_states = merged.model(torch.tensor([prompt])).last_hidden_state[0]
            base_vector = _pooled(reference("llama", prompt), pooling_type)
            want = _pooled(merged_states, pooling_type) if adapter_used else base_vector
            torch.testing.assert_close(vector, want, atol=ATOL, rtol=0)
            assert adapter_used is None or (vector - base_vector).abs().max() > 0.1
    _assert_clean(llm)


def test_pooling_requests_never_speculate_and_a_pooling_runner_refuses_speculation(tiny_checkpoints,
                                                                                   reference) -> None:
    prompts = [[5, 6, 7, 8] * 3 + [5, 6, 7], [9], [10, 11] * 8]  # patterns an n-gram would draft from
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, max_model_len=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    for got, prompt in zip(_encode(llm, prompts), prompts):
        torch.testing.assert_close(got, reference("llama", prompt)[-1], atol=ATOL, rtol=0)
    assert llm.stats()["spec_decode_num_draft_tokens"] == 0
    _assert_clean(llm)
    for method in ({"speculative_method": "ngram"}, {"speculative_method": "draft", "draft_model": "x"}):
        with pytest.raises(ValueError, match="speculative_method=.* with runner='pooling'"):
            EngineArgs(runner="pooling", **method).create_engine_config()


def test_a_generate_runner_refuses_pooling_options_it_would_ignore() -> None:
    for options, named in (({"pooling_type": "MEAN"}, "pooling_type"),
                           ({"pooling_normalize": False}, "pooling_normalize"),
                           ({"pooler_config": {"pooling_type": "CLS", "normalize": False}},
                            "pooling_type, pooling_normalize")):
        with pytest.raises(ValueError, match=f"{named} tune pooling requests, which runner='generate' does not serve"):
            EngineArgs(runner="generate", **EngineArgs.with_config_dicts(options)).create_engine_config()
    assert EngineArgs(runner="generate").create_engine_config().model.runner == "generate"


@pytest.mark.parametrize("scheduling_policy", ["fcfs", "lpm", "priority"])
def test_scheduling_policies_admit_pooling_requests_from_their_cache(tiny_checkpoints, reference,
                                                                     scheduling_policy) -> None:
    prompts = _prompts([5, 40, 17, 33])
    for pooling_type in ("LAST", "MEAN"):
        llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8,
                  scheduling_policy=scheduling_policy, pooler_config={"pooling_type": pooling_type})
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2, temperature=0),
                     use_tqdm=False)
        outs = llm.encode([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False), use_tqdm=False)
        expected_cached = [0, 32, 16, 32] if pooling_type == "LAST" else [0] * 4
        assert [out.num_cached_tokens for out in outs] == expected_cached
        for out, prompt in zip(outs, prompts):
            torch.testing.assert_close(out.outputs.data, _pooled(reference("llama", prompt), pooling_type),
                                       atol=ATOL, rtol=0)
        _assert_clean(llm)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weight_quantization_pools_its_own_model_in_any_chunking(tiny_checkpoints, reference, quantization) -> None:
    """Quantized weights move the states by design: close to transformers' in direction, and the same whether
    the prompt runs whole or in two-token chunks (step graphs among them)."""
    path = str(tiny_checkpoints["llama"])
    prompts = _prompts([5, 40, 1])
    whole = _encode(LLM(path, dtype="float32", num_kv_blocks=64, quantization=quantization), prompts, "token_embed")
    chunked_llm = LLM(path, dtype="float32", num_kv_blocks=64, quantization=quantization, max_num_batched_tokens=2)
    for a, b, prompt in zip(whole, _encode(chunked_llm, prompts, "token_embed"), prompts):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
        cosine = torch.nn.functional.cosine_similarity(a, reference("llama", prompt), dim=-1)
        assert cosine.min() > (0.99 if quantization == "int8" else 0.5), cosine
    _assert_clean(chunked_llm)


def test_gguf_blocks_and_mmap_pool_as_the_dequantized_file(tmp_path) -> None:
    from gguf import GGMLQuantizationType as Q

    from tests.model.test_loader import byte_level_tokens, tiny_llama, write_gguf

    gguf_file = write_gguf(tmp_path / "tiny-q4_1.gguf", tiny_llama(vocab_size=len(byte_level_tokens()[0])),
                           qtype=Q.Q4_1)
    prompts = [[5, 9, 30, 31, 40] * 4, [7] * 3, [8]]
    dense = _encode(LLM(str(gguf_file), num_kv_blocks=64, quantization="none"), prompts, "token_embed")
    for options in ({}, {"load_format": "mmap"}):
        llm = LLM(str(gguf_file), num_kv_blocks=64, max_num_batched_tokens=2, **options)
        assert llm.stats()["weights_format"].startswith("gguf Q4_1")
        for got, want in zip(_encode(llm, prompts, "token_embed"), dense):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        _assert_clean(llm)


def test_mmap_loaded_weights_pool_as_transformers(tiny_checkpoints, reference) -> None:
    prompts = _prompts([5, 40])
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, load_format="mmap")
    for got, prompt in zip(_encode(llm, prompts, "token_embed"), prompts):
        torch.testing.assert_close(got, reference("llama", prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_an_abort_or_a_failed_step_mid_prompt_frees_everything_and_the_id_serves_again(tiny_checkpoints, reference,
                                                                                       pooling_type) -> None:
    prompt = _prompts([40])[0]
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8,
              pooler_config={"pooling_type": pooling_type, "normalize": False})
    engine, runner = llm.engine, llm.engine.core.runner
    engine.add_request("x", {"prompt_token_ids": prompt}, PoolingParams())
    engine.step(), engine.step()
    assert list(runner.pooler._parts) == ["x"]
    [aborted] = engine.abort_request(["x"])
    assert aborted.finished and aborted.outputs is None
    engine.add_request("x", {"prompt_token_ids": prompt[:20]}, PoolingParams())
    torch.testing.assert_close(_run(llm)["x"].outputs.data, _pooled(reference("llama", prompt[:20]), pooling_type),
                               atol=ATOL, rtol=0)
    _assert_clean(llm)

    engine.add_request("x", {"prompt_token_ids": prompt}, PoolingParams())
    engine.step(), engine.step()
    forward = runner._forward
    runner._forward = lambda batch: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    runner._forward = forward
    engine.add_request("x", {"prompt_token_ids": prompt[:30]}, PoolingParams())
    torch.testing.assert_close(_run(llm)["x"].outputs.data, _pooled(reference("llama", prompt[:30]), pooling_type),
                               atol=ATOL, rtol=0)
    _assert_clean(llm)


def test_stats_count_a_pooled_prompts_tokens(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, block_size=8)
    _encode(llm, _prompts([40, 17]))
    _encode(llm, _prompts([40]))
    stats = llm.stats()
    assert stats["num_tokens_computed"] == 40 + 17 + 8  # the second 40 from its 32 cached tokens
    assert stats["prefix_cache_queries"] == 97 and stats["prefix_cache_hits"] == 32


@pytest.mark.slow
def test_tensor_parallel_token_embed_equals_one_rank(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    prompts = _prompts([12, 30])
    options = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    want = _encode(LLM(path, **options), prompts, "token_embed")
    with LLM(path, tensor_parallel_size=2, **options) as llm:
        for got, expected in zip(_encode(llm, prompts, "token_embed"), want):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        assert_all_blocks_free(llm)
