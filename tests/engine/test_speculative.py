"""N-gram speculative decoding through the whole engine: greedy output token for token that of plain decoding
on every family (with drafts both accepted and rejected), seeded sampling reproducible, stops applied inside
an accepted run, and no block left behind after preemption or an abort."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.checkpoint import ARCHITECTURES
from tests.conftest import assert_all_blocks_free

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# prompts that repeat themselves, so that the proposer has matches from the first step on
PROMPTS = [[7] * 12, [3, 4] * 6, [9, 1, 2] * 4]
GREEDY = SamplingParams(temperature=0, max_tokens=40)
SMALL = {"dtype": "float32", "block_size": 4, "max_model_len": 96}


def _token_ids(llm: LLM, params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _spec_llm(path, **options) -> LLM:
    return LLM(str(path), speculative_config=NGRAM, **{**SMALL, "num_kv_blocks": 64, **options})


@pytest.fixture(scope="module")
def plain(tiny_checkpoints) -> dict[str, list[list[int]]]:
    """Each family's greedy outputs without speculation."""
    return {arch: _token_ids(LLM(str(path), **SMALL, num_kv_blocks=64), GREEDY)
            for arch, path in tiny_checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_output_is_that_of_plain_decoding(tiny_checkpoints, plain, arch) -> None:
    llm = _spec_llm(tiny_checkpoints[arch])
    assert _token_ids(llm, GREEDY) == plain[arch]
    stats = llm.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert stats["spec_decode_num_emitted_tokens"] > stats["spec_decode_num_accepted_tokens"]
    assert_all_blocks_free(llm)
    # again, from the prefix cache: the blocks it published hold the accepted tokens' KV, never a rejected one's
    resumed = [p + o[:20] for p, o in zip(PROMPTS, plain[arch])]
    hits_before = llm.stats()["prefix_cache_hits"]
    assert _token_ids(llm, SamplingParams(temperature=0, max_tokens=20), resumed) == [o[20:] for o in plain[arch]]
    assert llm.stats()["prefix_cache_hits"] - hits_before == 3 * 28  # 7 of each prompt's 8 blocks: outputs too


def test_off_by_default(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), **SMALL, num_kv_blocks=64)
    _token_ids(llm, GREEDY)
    assert "spec_decode_num_draft_tokens" not in llm.stats()


def test_greedy_under_preemption_and_chunked_prefill_leaves_no_block(tiny_checkpoints, plain) -> None:
    llm = _spec_llm(tiny_checkpoints["gemma3"], num_kv_blocks=14, max_num_batched_tokens=8)
    assert _token_ids(llm, GREEDY) == plain["gemma3"]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert_all_blocks_free(llm)


def test_seeded_sampling_is_reproducible(tiny_checkpoints) -> None:
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11, max_tokens=30)
    llm = _spec_llm(tiny_checkpoints["gemma3"])
    first = _token_ids(llm, params)
    assert _token_ids(llm, params) == first
    assert _token_ids(_spec_llm(tiny_checkpoints["gemma3"]), params) == first
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("cut", [5, 17, 30])
def test_stop_token_and_max_tokens_inside_an_accepted_run(tiny_checkpoints, plain, cut) -> None:
    want = plain["gemma3"][0]
    stop_id = want[cut]
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id])
    expected = want[: want.index(stop_id) + 1]
    llm = _spec_llm(tiny_checkpoints["gemma3"])
    assert _token_ids(llm, params, PROMPTS[:1]) == [expected]
    assert _token_ids(llm, SamplingParams(temperature=0, max_tokens=cut), PROMPTS[:1]) == [want[:cut]]
    assert_all_blocks_free(llm)


def test_stop_string_inside_an_accepted_run(tiny_checkpoints) -> None:
    path = tiny_checkpoints["gemma3"]
    plain_out = LLM(str(path), **SMALL, num_kv_blocks=64).generate(
        [{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = plain_out.text[len(plain_out.text) // 2 :][:3]
    params = SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    want = LLM(str(path), **SMALL, num_kv_blocks=64).generate(
        [{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    llm = _spec_llm(path)
    got = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert want.token_ids != plain_out.token_ids  # the stop string did cut the output
    assert_all_blocks_free(llm)


def test_an_abort_mid_speculation_leaves_no_block(tiny_checkpoints) -> None:
    llm = _spec_llm(tiny_checkpoints["gemma3"])
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40))
    for _ in range(6):
        engine.step()
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    engine.abort_request(["r1"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)
