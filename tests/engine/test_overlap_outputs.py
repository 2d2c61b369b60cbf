"""Overlapped output processing (``LLMEngine.overlap_outputs``, on by default on CUDA): a step's outputs processed
while the device runs the next one give exactly the outputs of the plain loop, through n > 1, stop strings,
logprobs, prompt logprobs, seeded sampling, chunked prefill, preemption and n-gram speculation, and leave no
block behind. On CPU a launch finishes the step's work before it returns, so these tests check the ordering
and bookkeeping of the overlap; its speed is measured on a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.outputs import FinishReason, RequestOutput
from tests.conftest import assert_all_blocks_free

OPTIONS = {"dtype": "float32", "num_kv_blocks": 64}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]} for n in (5, 40, 17, 1, 33, 9)]


def summary(outputs: list[RequestOutput]) -> list:
    return [(o.prompt_logprobs, [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
                                 for c in o.outputs]) for o in outputs]


def both(path: str, params: SamplingParams, **options) -> tuple[list, list, LLM]:
    plain = LLM(path, **{**OPTIONS, **options})
    overlapped = LLM(path, **{**OPTIONS, **options})
    assert not plain.engine.overlap_outputs  # the default on CPU
    overlapped.engine.overlap_outputs = True
    expected = summary(plain.generate(prompts(), params, use_tqdm=False))
    return expected, summary(overlapped.generate(prompts(), params, use_tqdm=False)), overlapped


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, n=2),
    SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7),
], ids=["greedy-n2", "logprobs", "seeded"])
def test_overlapped_outputs_equal_the_plain_loop(tiny_checkpoints, params: SamplingParams) -> None:
    expected, overlapped, llm = both(str(tiny_checkpoints["llama"]), params)
    assert overlapped == expected
    assert_all_blocks_free(llm)


def test_a_stop_string_ends_a_request_that_ran_one_step_more(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    free = LLM(path, **OPTIONS).generate(prompts(), SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    stops = [o.outputs[0].text[3:6] for o in free if len(o.outputs[0].text) > 8]  # text from the middle
    params = SamplingParams(temperature=0, max_tokens=16, stop=stops)
    expected, overlapped, llm = both(path, params)
    assert overlapped == expected
    assert any(c[2] is FinishReason.STOP and isinstance(c[3], str) for _, cs in overlapped for c in cs)
    assert_all_blocks_free(llm)


def test_chunks_preemption_and_speculation_through_the_overlap(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["qwen3"])
    params = SamplingParams(temperature=0, max_tokens=20)
    expected, overlapped, llm = both(path, params, num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)
    assert overlapped == expected and llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)
    expected, overlapped, llm = both(path, params, speculative_config=NGRAM)
    assert overlapped == expected
    assert_all_blocks_free(llm)


def test_outputs_held_for_an_aborted_request_never_reach_a_new_one_of_its_id(tiny_checkpoints) -> None:
    """A step's outputs wait for the next call; an abort in between drops them, so that a request that takes the
    id next gets only its own tokens."""
    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first, second = prompts()[1], prompts()[4]
    expected = LLM(path, **OPTIONS).generate([second], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(path, **OPTIONS)
    engine = llm.engine
    engine.overlap_outputs = True
    engine.add_request("x", first, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine._held  # the second step's outputs, not processed yet
    engine.abort_request(["x"])
    engine.add_request("x", second, params)
    finals = []
    while engine.has_unfinished_requests():
        finals += engine.step(final_only=True)
    assert [o.outputs[0].token_ids for o in finals] == [expected]
    assert_all_blocks_free(llm)
