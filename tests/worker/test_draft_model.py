"""Draft-model speculation through the whole engine: greedy output token for token that of plain decoding on
every family (a small draft of another seed, and the target as its own draft, which accepts every draft);
the same with chunked prefill, preemption, prefix hits, stop strings, logprobs, n > 1, structured output and
an abort, with no block left behind; seeded sampling that of plain decoding; unsupported drafts refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.model.checkpoint import ARCHITECTURES, make_checkpoint
from tests.conftest import assert_all_blocks_free

PROMPTS = [[7] * 12, [3, 4] * 6, [9, 1, 2] * 4, list(range(20, 50))]
GREEDY = SamplingParams(temperature=0, max_tokens=40)
# the target as its own draft proposes the raw argmax: a penalty makes the target's choice differ at times,
# so drafts are both accepted and rejected
PENALISED = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.2)
SMALL = {"dtype": "float32", "block_size": 4, "max_model_len": 96, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per family, a one-layer draft of another seed (same tokenizer and vocabulary as the tiny target)."""
    root = tmp_path_factory.mktemp("drafts")
    return {arch: make_checkpoint(root / arch, arch, "tiny", seed=1, num_layers=1) for arch in ARCHITECTURES}


def _draft_llm(target: Path, draft: Path | None = None, k: int = 3, **options) -> LLM:
    speculative = {"method": "draft", "model": str(draft or target), "num_speculative_tokens": k}
    return LLM(str(target), speculative_config=speculative, **{**SMALL, **options})


def _outputs(llm: LLM, params, prompts: list[list[int]] = PROMPTS) -> list:
    return [o.outputs for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _token_ids(llm: LLM, params, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [samples[0].token_ids for samples in _outputs(llm, params, prompts)]


def _spec_stats(llm: LLM) -> tuple[int, int]:
    stats = llm.stats()
    return stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_output_is_that_of_plain_decoding(tiny_checkpoints, drafts, arch) -> None:
    target = tiny_checkpoints[arch]
    plain, small, itself = LLM(str(target), **SMALL), _draft_llm(target, drafts[arch]), _draft_llm(target)
    for params in (GREEDY, PENALISED):
        want = _token_ids(plain, params)
        assert _token_ids(small, params) == want
        before = _spec_stats(itself)
        assert _token_ids(itself, params) == want
        accepted, drafted = (after - then for after, then in zip(_spec_stats(itself), before))
        if params is GREEDY:  # the draft's KV is the target's, position for position: every draft is accepted
            assert accepted == drafted > 0
        else:
            assert 0 < accepted < drafted
    assert _spec_stats(small)[1] > 0
    assert_all_blocks_free(small)
    assert_all_blocks_free(itself)


def test_draft_kv_carries_over_prefix_hits_and_step_graphs_serve_the_draft(tiny_checkpoints) -> None:
    target = tiny_checkpoints["qwen3"]
    plain = _token_ids(LLM(str(target), **SMALL), GREEDY)
    llm = _draft_llm(target)
    assert _token_ids(llm, GREEDY) == plain
    resumed = [p + o[:20] for p, o in zip(PROMPTS, plain)]
    hits_before, (accepted_before, drafted_before) = llm.stats()["prefix_cache_hits"], _spec_stats(llm)
    assert _token_ids(llm, SamplingParams(temperature=0, max_tokens=20), resumed) == [o[20:] for o in plain]
    assert llm.stats()["prefix_cache_hits"] > hits_before
    accepted, drafted = _spec_stats(llm)
    # the cached blocks hold the draft's KV too: it still proposes exactly the target's tokens
    assert accepted - accepted_before == drafted - drafted_before > 0
    assert llm.engine.core.runner.draft.graphs.num_replays > 0
    assert_all_blocks_free(llm)


def test_the_pool_holds_both_models_kv(tiny_checkpoints, drafts) -> None:
    target = tiny_checkpoints["llama"]
    plain, spec = LLM(str(target), **SMALL), _draft_llm(target, drafts["llama"])
    assert spec.engine.core.runner.kv_bytes_per_block() == 3 * plain.engine.core.runner.kv_bytes_per_block() // 2
    budget = {**SMALL, "num_kv_blocks": None, "kv_cache_memory": 0.001}
    plain, spec = LLM(str(target), **budget), _draft_llm(target, drafts["llama"], **budget)
    assert spec.stats()["num_blocks_total"] == 2 * plain.stats()["num_blocks_total"] // 3
    assert spec.stats()["kv_cache_bytes"] <= 2**30 * 0.001


def test_greedy_under_preemption_and_chunked_prefill_leaves_no_block(tiny_checkpoints) -> None:
    target = tiny_checkpoints["gemma3"]
    want = _token_ids(LLM(str(target), **SMALL), PENALISED, PROMPTS[:3])
    llm = _draft_llm(target, num_kv_blocks=14, max_num_batched_tokens=8)
    assert _token_ids(llm, PENALISED, PROMPTS[:3]) == want
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and 0 < stats["spec_decode_num_accepted_tokens"], stats
    assert_all_blocks_free(llm)
    llm.engine.core.kv_manager.check_integrity([])


def test_seeded_sampling_is_that_of_plain_decoding(tiny_checkpoints) -> None:
    target = tiny_checkpoints["gemma3"]
    params = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=30)
    want = _token_ids(LLM(str(target), **SMALL), params)
    llm = _draft_llm(target)
    assert _token_ids(llm, params) == want
    accepted, drafted = _spec_stats(llm)
    assert 0 < accepted < drafted
    assert [_token_ids(llm, params, [p])[0] for p in PROMPTS[:2]] == want[:2]  # alone as in a batch
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_of_n_samples_speculates_on_its_own(tiny_checkpoints, temperature) -> None:
    target = tiny_checkpoints["llama"]
    params = SamplingParams(temperature=temperature, seed=5, n=3, max_tokens=30)
    want = [s.token_ids for s in _outputs(LLM(str(target), **SMALL), params, PROMPTS[3:])[0]]
    llm = _draft_llm(target)
    assert [s.token_ids for s in _outputs(llm, params, PROMPTS[3:])[0]] == want
    assert _spec_stats(llm)[0] > 0
    assert_all_blocks_free(llm)


def test_logprobs_and_stops_are_those_of_plain_decoding(tiny_checkpoints) -> None:
    target = tiny_checkpoints["qwen2"]
    plain_llm = LLM(str(target), **SMALL)
    text = _outputs(plain_llm, GREEDY, PROMPTS[:1])[0][0].text
    stop_token = _token_ids(plain_llm, GREEDY, PROMPTS[1:2])[0][17]
    params = [SamplingParams(temperature=0, max_tokens=30, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=40, stop=[text[len(text) // 2 :][:3]]),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token])]
    llm = _draft_llm(target)
    for p in params:
        ((got,),), ((want,),) = _outputs(llm, p, PROMPTS[:1]), _outputs(plain_llm, p, PROMPTS[:1])
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        for got_step, want_step in zip(got.logprobs or [], want.logprobs or []):
            assert list(got_step) == list(want_step)
            for token_id, entry in want_step.items():
                assert got_step[token_id].logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert _outputs(llm, params[1], PROMPTS[:1])[0][0].token_ids != _token_ids(plain_llm, GREEDY, PROMPTS[:1])[0]
    assert _spec_stats(llm)[0] > 0
    assert_all_blocks_free(llm)


def test_structured_output_is_that_of_plain_decoding(tiny_checkpoints) -> None:
    target = tiny_checkpoints["llama"]
    params = [SamplingParams(temperature=0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=r"(ab ){3,12}[0-9]{3}")),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json={"type": "object"}))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    want = [o.outputs[0].token_ids for o in LLM(str(target), **SMALL).generate(prompts, params, use_tqdm=False)]
    llm = _draft_llm(target)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert _spec_stats(llm)[1] > 0
    assert llm.engine.core.runner.sampler.num_states == 0
    assert_all_blocks_free(llm)


def test_an_abort_mid_speculation_leaves_no_block(tiny_checkpoints, drafts) -> None:
    llm = _draft_llm(tiny_checkpoints["gemma3"], drafts["gemma3"])
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, PENALISED)
    for _ in range(4):
        engine.step()
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    engine.abort_request(["r1", "r3"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)
    assert engine.core.runner.draft.num_requests == 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_checkpoints, tmp_path) -> None:
    other = make_checkpoint(tmp_path / "small", "llama", "small", seed=0, num_layers=1)
    with pytest.raises(ValueError, match="vocabulary"):
        _draft_llm(tiny_checkpoints["llama"], other)


def _padded_copy(draft: Path, out: Path, extra_rows: int) -> Path:
    """The draft with its embeddings and head padded past its tokenizer (as Qwen2.5 0.5B's are against 7B's)."""
    shutil.copytree(draft, out)
    config = json.loads((out / "config.json").read_text())
    for file in out.glob("*.safetensors"):
        tensors = {name: torch.cat([t, torch.zeros(extra_rows, t.shape[1], dtype=t.dtype)])
                   if t.dim() == 2 and t.shape[0] == config["vocab_size"] else t
                   for name, t in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
    config["vocab_size"] += extra_rows
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_draft_padded_past_the_shared_tokenizer_is_used(tiny_checkpoints, drafts, tmp_path) -> None:
    """The draft's padding rows may win its argmax: they are never proposed (not target tokens)."""
    target = tiny_checkpoints["llama"]
    padded = _padded_copy(drafts["llama"], tmp_path / "padded", 128)
    llm = _draft_llm(target, padded)
    assert _token_ids(llm, GREEDY) == _token_ids(LLM(str(target), **SMALL), GREEDY)
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0


def test_a_draft_of_the_same_size_with_another_tokenizer_is_refused(tiny_checkpoints, drafts, tmp_path) -> None:
    other = tmp_path / "other"
    shutil.copytree(drafts["llama"], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    ids = sorted(tokenizer["model"]["vocab"].values())
    tokenizer["model"]["vocab"] = dict(zip(tokenizer["model"]["vocab"], reversed(ids)))  # every id another token
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        _draft_llm(tiny_checkpoints["llama"], other)
