"""--logprobs-mode and --max-logprobs through the whole engine on a tiny checkpoint: each mode's values against
transformers' logits processed by hand (temperature, repetition penalty, logit_bias, top-k), the same under n-gram
speculation, prompt logprobs the model's own, and the bound on how many alternatives a request asks for."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.config import LOGPROBS_MODES
from kvserve.outputs import PositionLogprobs
from kvserve.sampling_params import InvalidParameter
from tests.conftest import assert_all_blocks_free

SMALL = {"dtype": "float32", "block_size": 4, "max_model_len": 96, "num_kv_blocks": 64}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = [7, 30, 41, 7, 30, 41, 7, 30, 41, 7]  # repeats itself, so that the proposer has drafts
PROCESSED = dict(repetition_penalty=1.3, logit_bias={41: 2.0, 30: -1.5}, max_tokens=14, ignore_eos=True, logprobs=4,
                 prompt_logprobs=3)
GREEDY = SamplingParams(temperature=0.0, **PROCESSED)
RANDOM = SamplingParams(temperature=0.7, top_k=6, seed=11, **PROCESSED)


@pytest.fixture(scope="module")
def path(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def hf_logits(path):
    """transformers' logits (fp32) at every position of a token sequence: [len(ids), V]."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]

    return logits


def _processed(logits: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    """Logits as the draw takes them, by hand: bias, the repetition penalty over the prompt and the outputs so far,
    then, sampling at random, temperature and top-k."""
    out = logits.clone()
    for token, bias in params.logit_bias.items():
        out[token] += bias
    seen = sorted(set(history))
    penalty = params.repetition_penalty
    out[seen] = torch.where(out[seen] > 0, out[seen] / penalty, out[seen] * penalty)
    if params.is_greedy:
        return out
    out /= params.temperature
    out[out < out.topk(params.top_k).values[-1]] = -float("inf")
    return out


def _expected(logits: torch.Tensor, mode: str) -> torch.Tensor:
    return torch.log_softmax(logits, -1) if mode.endswith("logprobs") else logits


def _assert_values(position: PositionLogprobs, expected: torch.Tensor) -> None:
    """Each entry's value is the expected one, and so is the value its rank has among the expected (up to the
    last bits, which kvserve's kernels and transformers' sum in other orders)."""
    ranked = expected.sort(descending=True).values
    for token_id, entry in position.items():
        assert entry.logprob == pytest.approx(expected[token_id].item(), abs=1e-4), token_id
        assert ranked[entry.rank - 1].item() == pytest.approx(expected[token_id].item(), abs=1e-4), token_id


def _generate(llm: LLM, params: SamplingParams):
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return out


@pytest.mark.parametrize("params", [GREEDY, RANDOM], ids=["greedy", "random"])
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_each_mode_gives_the_values_it_names(path, hf_logits, mode: str, params: SamplingParams) -> None:
    llm = LLM(str(path), logprobs_mode=mode, **SMALL)
    out = _generate(llm, params)
    (sample,) = out.outputs
    outputs = list(sample.token_ids)
    assert len(sample.logprobs) == len(outputs) == params.max_tokens
    reference = hf_logits(PROMPT + outputs[:-1])
    for j, (token_id, position) in enumerate(zip(outputs, sample.logprobs)):
        logits = reference[len(PROMPT) - 1 + j]
        if mode.startswith("processed"):
            logits = _processed(logits, PROMPT + outputs[:j], params)
        assert token_id in position and len(position) in (params.logprobs, params.logprobs + 1)
        _assert_values(position, _expected(logits, mode))
    if mode.startswith("processed") and not params.is_greedy:  # top_k 6: the 5 alternatives lie within it
        assert all(entry.logprob > -float("inf") for position in sample.logprobs for entry in position.values())
    # the prompt's: the model's own in every mode (logits in the logits modes), as in vLLM
    assert out.prompt_logprobs[0] is None
    for j, position in enumerate(out.prompt_logprobs[1:]):
        _assert_values(position, _expected(reference[j], mode.replace("processed", "raw")))
    assert_all_blocks_free(llm)


# a repetition penalty below 1 favours what came before, so that drafts get accepted (and rejected)
SPECULATED = dict(repetition_penalty=0.8, logit_bias={7: 1.0}, max_tokens=30, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_ngram_speculation_gives_the_logprobs_of_plain_decoding(path, mode: str) -> None:
    """A speculating request's values come from the verifying step's rows, each processed with the history plain
    decoding would have had at its position (its drafts taken as outputs)."""
    spec = LLM(str(path), logprobs_mode=mode, speculative_config=NGRAM, **SMALL)
    plain = LLM(str(path), logprobs_mode=mode, **SMALL)
    prompts = [{"prompt_token_ids": [7] * 12}, {"prompt_token_ids": [3, 4] * 6}]
    for params in (SamplingParams(temperature=0.0, **SPECULATED),
                   SamplingParams(temperature=0.7, top_k=6, seed=11, **SPECULATED)):
        got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (spec, plain))
        for (g,), (w,) in zip((o.outputs for o in got), (o.outputs for o in want)):
            assert g.token_ids == w.token_ids
            for g_step, w_step in zip(g.logprobs, w.logprobs):
                assert list(g_step) == list(w_step)  # the chosen token, then the same top 3
                assert [e.logprob for e in g_step.values()] == \
                    pytest.approx([e.logprob for e in w_step.values()], abs=1e-4)
                assert [e.rank for e in g_step.values()] == [e.rank for e in w_step.values()]
    stats = spec.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert_all_blocks_free(spec)


@pytest.fixture(scope="module")
def bounded(path) -> LLM:
    return LLM(str(path), max_logprobs=3, **SMALL)


@pytest.mark.parametrize("field, value", [("logprobs", 4), ("prompt_logprobs", 4), ("logprobs", -1),
                                          ("prompt_logprobs", -1)])
def test_more_alternatives_than_max_logprobs_are_refused_by_name(bounded: LLM, field: str, value: int) -> None:
    asked = 512 if value == -1 else value  # -1: the tiny vocabulary's 512
    with pytest.raises(InvalidParameter, match=f"{field} asks for {asked} alternatives a position, more than the 3"
                                               " that max_logprobs allows") as raised:
        _generate(bounded, SamplingParams(max_tokens=2, **{field: value}))
    assert raised.value.param == field
    assert_all_blocks_free(bounded)
    (sample,) = _generate(bounded, SamplingParams(max_tokens=2, temperature=0, logprobs=3)).outputs
    assert all(len(position) >= 3 for position in sample.logprobs)


def test_the_default_bound_is_vllms_twenty(path) -> None:
    llm = LLM(str(path), **SMALL)
    with pytest.raises(InvalidParameter, match="more than the 20 that max_logprobs allows"):
        _generate(llm, SamplingParams(max_tokens=1, logprobs=21))
    assert len(_generate(llm, SamplingParams(max_tokens=1, prompt_logprobs=20)).prompt_logprobs[1]) >= 20


def test_minus_one_asks_for_the_whole_vocabulary_where_max_logprobs_allows_it(path) -> None:
    llm = LLM(str(path), max_logprobs=-1, **SMALL)
    out = _generate(llm, SamplingParams(max_tokens=2, temperature=0, logprobs=-1, prompt_logprobs=-1))
    vocab = range(512)
    assert all(sorted(position) == list(vocab) for position in out.outputs[0].logprobs)
    assert all(sorted(position) == list(vocab) for position in out.prompt_logprobs[1:])
    ranks = sorted(entry.rank for entry in out.outputs[0].logprobs[0].values())
    assert ranks[0] == 1 and ranks[-1] <= 512
