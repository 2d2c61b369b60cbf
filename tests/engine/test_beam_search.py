"""LLM.beam_search against an exact beam search written here over transformers (fp32): the same sequences and
cumulative logprobs, greedy at width 1, EOS and length penalty as vLLM ranks them; the beams' KV shared through
the prefix cache; bad input refused by name; nothing left behind."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM
from kvserve.outputs import FinishReason
from kvserve.sampling_params import BeamSearchParams, SamplingParams
from tests.conftest import assert_all_blocks_free, greedy_token_ids, hf_greedy

MAX_TOKENS = 10


@dataclass
class Reference:
    tokens: list[int]
    cum_logprob: float
    ended_by_eos: bool


def reference_beam_search(hf: torch.nn.Module, prompt: list[int], width: int, max_tokens: int, eos: int,
                          ignore_eos: bool = False, length_penalty: float = 1.0) -> list[Reference]:
    """vLLM's beam search, whole sequences through the model each step: every live beam extended by its 2 *
    width most likely tokens; those ending in EOS complete, the best width others live on; the answer is the best
    width of all by cumulative logprob over length ** length_penalty (the prompt counted, an ending EOS not, even
    under ignore_eos: vLLM's get_beam_search_score)."""
    def score(ref: Reference) -> float:
        return ref.cum_logprob / (len(ref.tokens) - (ref.tokens[-1] == eos)) ** length_penalty

    live, completed = [Reference(list(prompt), 0.0, False)], []
    for _ in range(max_tokens):
        candidates = []
        for beam in live:
            with torch.no_grad():
                logits = hf(torch.tensor([beam.tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, dim=-1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                ends = token == eos and not ignore_eos
                (completed if ends else candidates).append(Reference(beam.tokens + [token],
                                                                     beam.cum_logprob + logprob, ends))
        live = sorted(candidates, key=score, reverse=True)[:width]
        if not live:
            break
    return sorted(completed + live, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4)
    eos = hf.config.eos_token_id
    return llm, hf, eos


def _prompt(seed: int, length: int = 9, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(length)]


def _prompt_whose_search_ends_at_eos(hf, eos: int, width: int) -> list[int]:
    """A prompt whose best sequences include one that EOS ended (the tiny model draws EOS rarely: looked for)."""
    for seed in range(200):
        prompt = _prompt(seed, length=6)
        if any(r.ended_by_eos for r in reference_beam_search(hf, prompt, width, MAX_TOKENS, eos)):
            return prompt
    raise AssertionError("no prompt of 200 reaches EOS")


def _assert_matches(outputs, expected: list[list[Reference]]) -> None:
    for output, want in zip(outputs, expected, strict=True):
        assert [s.tokens for s in output.sequences] == [r.tokens for r in want]
        for sequence, ref in zip(output.sequences, want):
            assert sequence.cum_logprob == pytest.approx(ref.cum_logprob, abs=1e-4)
            assert (sequence.finish_reason is FinishReason.STOP) == ref.ended_by_eos


@pytest.mark.parametrize("width", [1, 2, 4])
def test_the_sequences_and_logprobs_are_the_reference_beam_search(llama, width: int) -> None:
    llm, hf, eos = llama
    prompts = [_prompt(1), _prompt(2, length=21)]  # several prompts searched in one batch
    expected = [reference_beam_search(hf, p, width, MAX_TOKENS, eos) for p in prompts]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(width, MAX_TOKENS))
    _assert_matches(outputs, expected)
    assert all(len(o.sequences) == width for o in outputs)
    assert_all_blocks_free(llm)


def test_width_one_is_greedy(llama) -> None:
    llm, hf, _ = llama
    prompt = _prompt(3)
    (output,) = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(1, MAX_TOKENS, ignore_eos=True))
    greedy = greedy_token_ids(llm, [prompt], MAX_TOKENS)[0][0]
    assert output.sequences[0].tokens[len(prompt):] == greedy == hf_greedy(hf, prompt, MAX_TOKENS)


@pytest.mark.parametrize("width", [2, 4])
def test_a_sequence_eos_ends_completes_and_its_eos_is_not_counted(llama, width: int) -> None:
    llm, hf, eos = llama
    prompt = _prompt_whose_search_ends_at_eos(hf, eos, width)
    params = BeamSearchParams(width, MAX_TOKENS)
    (output,) = llm.beam_search({"prompt_token_ids": prompt}, params)
    _assert_matches([output], [reference_beam_search(hf, prompt, width, MAX_TOKENS, eos)])
    ended = [s for s in output.sequences if s.finish_reason is FinishReason.STOP]
    assert ended and all(s.tokens[-1] == eos for s in ended)
    # ignore_eos: EOS is a token as any other, and every sequence runs to max_tokens
    (output,) = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(width, MAX_TOKENS, ignore_eos=True))
    _assert_matches([output], [reference_beam_search(hf, prompt, width, MAX_TOKENS, eos, ignore_eos=True)])
    assert all(len(s.tokens) == len(prompt) + MAX_TOKENS and s.finish_reason is FinishReason.LENGTH
               for s in output.sequences)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("length_penalty", [0.0, 2.0])
def test_the_length_penalty_ranks_as_the_reference(llama, length_penalty: float) -> None:
    llm, hf, eos = llama
    prompt = _prompt_whose_search_ends_at_eos(hf, eos, 4)
    expected = reference_beam_search(hf, prompt, 4, MAX_TOKENS, eos, length_penalty=length_penalty)
    outputs = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(4, MAX_TOKENS,
                                                                             length_penalty=length_penalty))
    _assert_matches(outputs, [expected])


def test_the_text_is_the_prompts_and_the_sequences_as_vllm_gives_it(llama) -> None:
    llm, hf, eos = llama
    (output,) = llm.beam_search("Hello there", BeamSearchParams(2, 4))
    tokenizer = llm.get_tokenizer()
    for sequence in output.sequences:
        assert sequence.text == tokenizer.decode(sequence.tokens)
        assert sequence.text.startswith("Hello there") and len(sequence.logprobs) == 4


def test_the_beams_share_their_kv_through_the_prefix_cache(tiny_checkpoints) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=256, block_size=4)
    llm.beam_search({"prompt_token_ids": _prompt(4, length=40)}, BeamSearchParams(4, 16, ignore_eos=True))
    stats = llm.stats()
    # each step's beams find all but their partial last block (and the one token every request computes): measured
    # 0.94, 184 tokens computed for 2,920 prompt tokens (61 requests of 40 to 55 tokens, blocks of 4; 0.81 with
    # blocks of 16); a beam whose KV were computed anew would hit nothing
    assert stats["prefix_cache_hit_rate"] > 0.9, stats
    assert stats["num_tokens_computed"] < 0.1 * stats["prefix_cache_queries"], stats
    assert_all_blocks_free(llm)


def test_the_score_counts_the_prompt_and_not_an_ending_eos() -> None:
    from kvserve.engine.beam_search import BeamSearch, BeamSearchSequence
    from kvserve.engine.input_processor import ProcessedPrompt

    params = BeamSearchParams(2, 4, length_penalty=2.0)
    search = BeamSearch(ProcessedPrompt(None, [5, 6, 7], SamplingParams(max_tokens=1)), params, {3})
    assert search.score(BeamSearchSequence([5, 6, 7, 9, 3], [], -6.0, finish_reason=FinishReason.STOP)) == -6 / 4**2
    # a live sequence ending in EOS (ignore_eos kept it going) is scored as vLLM scores it: the EOS not counted
    assert search.score(BeamSearchSequence([5, 6, 7, 9, 3], [], -6.0)) == -6 / 4**2
    assert search.score(BeamSearchSequence([5, 6, 7, 9, 8], [], -6.0)) == -6 / 5**2


def test_only_the_2_x_width_most_likely_and_the_drawn_token_are_candidates() -> None:
    """Where an answer asks for more logprobs than the search needs, the others are shown, not searched."""
    from kvserve.engine.beam_search import BeamSearch
    from kvserve.engine.input_processor import ProcessedPrompt
    from kvserve.outputs import CompletionOutput, Logprob, RequestOutput

    search = BeamSearch(ProcessedPrompt(None, [5, 6], SamplingParams(max_tokens=1)), BeamSearchParams(1, 4), {3})
    position = {token: Logprob(-float(rank), rank) for rank, token in enumerate([10, 11, 3, 12, 13, 40], start=1)}
    drawn = 40  # a temperature's draw, ranked last: a candidate too, as in vLLM
    sample = CompletionOutput(0, "", [drawn], FinishReason.LENGTH, None, [position])
    search.advance([RequestOutput("r", None, [5, 6], [sample], finished=True)], first_step=True)
    assert [beam.tokens for beam in search.live] == [[5, 6, 10]]
    assert search.completed == []  # EOS ranked 3rd is no candidate of a width-1 search


@pytest.mark.parametrize("fields, param", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": BeamSearchParams.MAX_BEAM_WIDTH + 1, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
])
def test_bad_params_are_a_value_error_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ValueError, match=param) as raised:
        BeamSearchParams(**fields)
    assert raised.value.param == param


def test_max_tokens_over_the_context_is_refused_before_anything_runs(llama) -> None:
    llm, _, _ = llama
    max_model_len = llm.engine.max_model_len
    with pytest.raises(ValueError, match="max_tokens") as raised:
        llm.beam_search([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": _prompt(5)}],
                        BeamSearchParams(2, max_model_len - 5))
    assert raised.value.param == "max_tokens"
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["num_running"] == 0
    assert_all_blocks_free(llm)


def test_an_interrupted_search_leaves_no_request_and_no_block(llama, monkeypatch) -> None:
    llm, _, _ = llama
    step, calls = llm.engine.step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search({"prompt_token_ids": _prompt(6)}, BeamSearchParams(4, MAX_TOKENS))
    monkeypatch.undo()
    assert not llm.engine.core.scheduler.requests and not llm.engine.output_processor.request_ids()
    assert_all_blocks_free(llm)
    (output,) = llm.beam_search({"prompt_token_ids": _prompt(6)}, BeamSearchParams(2, 2))  # it serves on
    assert len(output.sequences) == 2
