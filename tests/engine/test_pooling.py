"""Pooling requests (``LLM.encode`` / ``embed`` / ``score``): hidden states equal to transformers' (fp32, CPU) for
every family and pooling type, through chunked prefill, preemption and the prefix cache, beside generation."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.model.checkpoint import ARCHITECTURES
from kvserve.pooling_params import PoolingParams, UnsupportedTask
from kvserve.sampling_params import InvalidParameter
from tests.conftest import assert_all_blocks_free, hf_greedy

LENGTHS = [5, 40, 17, 1, 33]
ATOL = 1e-4  # fp32: the engine's kernels sum in another order than transformers' ops


def _prompts(vocab_size: int, lengths: list[int] = LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def _token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def family(request: pytest.FixtureRequest, tiny_checkpoints):
    path = tiny_checkpoints[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        hidden = [hf.model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
    return path, hf, prompts, hidden


def _expected(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    return {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_transformers_hidden_states_through_8_token_chunks(family, pooling_type) -> None:
    path, _, prompts, hidden = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8,
              pooler_config={"pooling_type": pooling_type, "normalize": False})
    outs = llm.encode(_token_prompts(prompts), use_tqdm=False)
    for out, states in zip(outs, hidden):
        assert out.finished and out.outputs is not None
        torch.testing.assert_close(out.outputs.data, _expected(states, pooling_type), atol=ATOL, rtol=0)
    assert_all_blocks_free(llm)


def test_token_embed_returns_every_prompt_tokens_states(family) -> None:
    path, _, prompts, hidden = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8)
    outs = llm.encode(_token_prompts(prompts), PoolingParams(task="token_embed", normalize=False), use_tqdm=False)
    for out, states in zip(outs, hidden):
        torch.testing.assert_close(out.outputs.data, states, atol=ATOL, rtol=0)
    assert_all_blocks_free(llm)


def test_embed_normalizes_by_default_and_a_request_may_say_otherwise(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    unit = torch.tensor(llm.embed(prompt, use_tqdm=False)[0].outputs.embedding)
    raw = llm.encode(prompt, PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    assert torch.linalg.vector_norm(unit).item() == pytest.approx(1.0, abs=1e-5)
    assert torch.linalg.vector_norm(raw).item() > 1.5  # RMS-normed states of a 64-wide model: far from unit length
    torch.testing.assert_close(unit, raw / torch.linalg.vector_norm(raw), atol=1e-6, rtol=0)
    rows = llm.encode(prompt, pooling_task="token_embed", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(torch.linalg.vector_norm(rows, dim=-1), torch.ones(4), atol=1e-5, rtol=0)


def test_pooling_beside_generation_leaves_both_exact(family) -> None:
    """Pooling and generation requests in the same steps (the engine serves both by default): the tokens are
    transformers' greedy ones, the embeddings its hidden states."""
    path, hf, prompts, hidden = family
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
              pooler_config={"normalize": False})
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"gen-{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6))
        engine.add_request(f"emb-{i}", {"prompt_token_ids": prompt}, PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    for i, (prompt, states) in enumerate(zip(prompts, hidden)):
        assert list(finished[f"gen-{i}"].outputs[0].token_ids) == hf_greedy(hf, prompt, 6)
        torch.testing.assert_close(finished[f"emb-{i}"].outputs.data, states[-1], atol=ATOL, rtol=0)
    assert_all_blocks_free(llm)


def test_a_pooled_prompt_is_cached_for_later_requests(tiny_checkpoints) -> None:
    """LAST pooling runs only the tokens past a cached prefix (the last one's state is the same); its KV serves a
    generation of the same prompt. MEAN and CLS read every token's state: they start from none cached."""
    prompt = {"prompt_token_ids": list(range(3, 3 + 37))}
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, block_size=8)
    first, again = (llm.encode(prompt, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    torch.testing.assert_close(again.outputs.data, first.outputs.data, atol=ATOL, rtol=0)
    generated = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert generated.num_cached_tokens == 32
    mean = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, block_size=8,
               pooler_config={"pooling_type": "MEAN"})
    first, again = (mean.encode(prompt, use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens == 0
    torch.testing.assert_close(again.outputs.data, first.outputs.data, atol=ATOL, rtol=0)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_a_pooling_request_preempted_mid_prompt_still_matches(family, pooling_type, preemption_mode) -> None:
    """One seat, 8-token chunks: a 40-token pooling request is displaced after its first chunk by a request of a
    lower priority value, then resumes: recomputed (from its cached prefix, where its pooling allows) or from its
    swapped-out KV, its chunks before the preemption kept by the pooler."""
    path, _, prompts, hidden = family
    swap = {"kv_offload_memory": 0.01} if preemption_mode == "swap" else {}
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=1,
              scheduling_policy="priority", preemption_mode=preemption_mode, **swap,
              pooler_config={"pooling_type": pooling_type, "normalize": False})
    engine = llm.engine
    engine.add_request("long", {"prompt_token_ids": prompts[1]}, PoolingParams(), priority=1)
    engine.step()
    engine.add_request("urgent", {"prompt_token_ids": prompts[0]}, PoolingParams(), priority=0)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    assert llm.stats()["num_preemptions"] == 1
    torch.testing.assert_close(finished["long"].outputs.data, _expected(hidden[1], pooling_type), atol=ATOL, rtol=0)
    torch.testing.assert_close(finished["urgent"].outputs.data, _expected(hidden[0], pooling_type), atol=ATOL, rtol=0)
    assert_all_blocks_free(llm)


def test_score_is_the_cosine_similarity_of_the_embeddings(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64)
    texts = ["the cat sat", "a dog ran far", "the cat sat down"]
    embeddings = [torch.tensor(out.outputs.embedding) for out in llm.embed(texts, use_tqdm=False)]
    scores = llm.score(texts[0], texts[1:], use_tqdm=False)
    for score, other in zip(scores, embeddings[1:]):
        assert score.outputs.score == pytest.approx(torch.dot(embeddings[0], other).item(), abs=1e-5)
    # each pair named by its two requests, as vLLM names them: the one first text's id alone named every pair
    assert len({score.request_id for score in scores}) == len(scores)
    assert all(score.request_id.count("_") == 1 for score in scores)
    pairwise = llm.score(texts[:2], texts[1:], use_tqdm=False)
    assert pairwise[0].outputs.score == pytest.approx(scores[0].outputs.score, abs=1e-6)
    with pytest.raises(ValueError, match="score pairs 1 to 1, 1 to N or N to N"):
        llm.score(texts[:2], texts, use_tqdm=False)


def test_a_pooling_prompt_may_fill_max_model_len_and_truncation_keeps_its_end(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, max_model_len=32)
    prompt = list(range(3, 3 + 40))
    assert len(llm.encode({"prompt_token_ids": prompt[:32]}, use_tqdm=False)[0].prompt_token_ids) == 32
    with pytest.raises(InvalidParameter, match="max_model_len=32"):
        llm.encode({"prompt_token_ids": prompt}, use_tqdm=False)
    # a cut that still leaves too many tokens is the cut's fault, not the prompt's (whose refusal advises a cut)
    with pytest.raises(InvalidParameter, match="truncate_prompt_tokens=35 keeps 35 tokens") as error:
        llm.encode({"prompt_token_ids": prompt}, truncate_prompt_tokens=35, use_tqdm=False)
    assert error.value.param == "truncate_prompt_tokens"
    cut = llm.encode({"prompt_token_ids": prompt}, truncate_prompt_tokens=10, use_tqdm=False)[0]
    tail = llm.encode({"prompt_token_ids": prompt[-10:]}, use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-10:]
    torch.testing.assert_close(cut.outputs.data, tail.outputs.data, atol=ATOL, rtol=0)
    assert_all_blocks_free(llm)


def test_refusals_name_what_is_wrong(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidParameter, match="dimensions") as error:
        llm.embed("hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    assert error.value.param == "dimensions"
    with pytest.raises(InvalidParameter, match="task"):
        PoolingParams(task="classify")
    with pytest.raises(ValueError, match="pooling_task='token_embed'"):
        llm.encode("hello", PoolingParams(), pooling_task="token_embed", use_tqdm=False)
    pooling = LLM(path, dtype="float32", num_kv_blocks=64, runner="pooling")
    with pytest.raises(UnsupportedTask, match="'generate'"):
        pooling.generate("hello", use_tqdm=False)
    assert pooling.engine.supported_tasks == ("embed", "token_embed")
    generating = LLM(path, dtype="float32", num_kv_blocks=64, runner="generate")
    with pytest.raises(UnsupportedTask, match="'embed'"):
        generating.embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="pooler_config: unknown keys \\['softmax'\\]"):
        LLM(path, pooler_config={"softmax": True})
    for llm in (llm, pooling, generating):
        assert_all_blocks_free(llm)


def test_async_encode_answers_in_input_order_and_a_bad_prompt_queues_none(tiny_checkpoints) -> None:
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine_args import EngineArgs

    path = str(tiny_checkpoints["llama"])
    engine = AsyncEngine(LLMEngine(EngineArgs(model=path, dtype="float32", num_kv_blocks=64).create_engine_config()))
    engine.start()
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (9, 2, 30)]
    try:
        outs = asyncio.run(engine.encode(prompts, PoolingParams(), request_ids=["a", "b", "c"]))
        assert [out.request_id for out in outs] == ["a", "b", "c"]
        offline = LLM(path, dtype="float32", num_kv_blocks=64).encode(prompts, use_tqdm=False)
        for out, want in zip(outs, offline):
            torch.testing.assert_close(out.outputs.data, want.outputs.data, atol=ATOL, rtol=0)
        with pytest.raises(InvalidParameter, match="prompt_token_ids"):
            asyncio.run(engine.encode([prompts[0], {"prompt_token_ids": [10**9]}], PoolingParams()))
        assert engine.num_unfinished() == 0
        assert asyncio.run(engine.call(lambda e: e.stats()["num_blocks_used"])) == 0
    finally:
        engine.shutdown()


def test_tensor_parallel_pooling_equals_one_rank(tiny_checkpoints) -> None:
    """Rank 0 pools the full hidden states (the layers' all-reduce gives every rank them); the workers pool
    nothing."""
    path = str(tiny_checkpoints["llama"])
    prompts = _token_prompts(_prompts(512, [12, 30]))
    options = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, pooler_config={"pooling_type": "MEAN"})
    want = LLM(path, **options).encode(prompts, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **options) as llm:
        got = llm.encode(prompts, use_tqdm=False)
        for out, expected in zip(got, want):
            torch.testing.assert_close(out.outputs.data, expected.outputs.data, atol=ATOL, rtol=0)
        assert_all_blocks_free(llm)
