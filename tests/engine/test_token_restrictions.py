"""vLLM's token restrictions through the whole engine: ``allowed_token_ids``, ``bad_words`` (and their token ids)
and ``truncate_prompt_tokens``, greedy output equal to transformers' logits restricted by the same rule, with and
without speculative decoding; every block free afterwards."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free

MAX_NEW = 10
PROMPTS = [[7] * 12, [3, 4] * 6, [9, 1, 2, 50, 60] * 3]  # repetitive: the n-gram proposer drafts from the start
Restriction = Callable[[list[int]], tuple[set[int] | None, set[int]]]  # outputs -> (allowed or None, banned)


@pytest.fixture(scope="module")
def hf(tiny_checkpoints) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[None, {"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3}],
                ids=["plain", "speculating"])
def llm(request: pytest.FixtureRequest, tiny_checkpoints) -> LLM:
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=64, block_size=4,
               speculative_config=request.param)


def restricted_greedy(hf: torch.nn.Module, prompt: list[int], restriction: Restriction) -> list[int]:
    """transformers' greedy continuation with each step's logits restricted as ``restriction`` says."""
    outputs: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = hf(torch.tensor([prompt + outputs])).logits[0, -1]
            allowed, banned = restriction(outputs)
            if allowed is not None:
                kept = torch.full_like(logits, -float("inf"))
                kept[list(allowed)] = logits[list(allowed)]
                logits = kept
            logits[list(banned)] = -float("inf")
            outputs.append(int(logits.argmax()))
    return outputs


def generate(llm: LLM, prompts: list[list[int]], **params) -> list[list[int]]:
    sampling = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_allowed_token_ids_are_all_that_is_drawn(llm: LLM, hf) -> None:
    allowed = [3, 4, 9, 17, 50]
    got = generate(llm, PROMPTS, allowed_token_ids=allowed)
    assert got == [restricted_greedy(hf, p, lambda _: (set(allowed), set())) for p in PROMPTS]
    sampled = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_NEW, allowed_token_ids=allowed),
                           use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in sampled)
    assert_all_blocks_free(llm)


def test_bad_words_never_end_the_outputs(llm: LLM, hf) -> None:
    """A word's last token is banned where the outputs end with the rest of it (a one-token word: always);
    the prompt is not looked at (vLLM's rule)."""
    free = generate(llm, PROMPTS)
    words = [tuple(free[0][1:3]), (free[1][0],), tuple(free[2][2:5])]

    def bans(outputs: list[int]) -> tuple[None, set[int]]:
        return None, {w[-1] for w in words if len(w) == 1 or outputs[len(outputs) - len(w) + 1:] == list(w[:-1])}

    got = generate(llm, PROMPTS, bad_words_token_ids=words)
    assert got == [restricted_greedy(hf, p, bans) for p in PROMPTS]
    for outputs in got:
        assert not any(tuple(outputs[i:i + len(w)]) == w for w in words for i in range(len(outputs)))
    assert_all_blocks_free(llm)


def test_bad_words_are_tokenized_as_they_start_a_text_and_after_a_space(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    (out,) = llm.generate("the weather today", SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                          use_tqdm=False)
    word = tokenizer.decode(out.outputs[0].token_ids[2:4]).strip() or "x"
    (banned,) = llm.generate("the weather today", SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                                 bad_words=[word]), use_tqdm=False)
    alone = tuple(tokenizer.encode(word, add_special_tokens=False))
    outputs = banned.outputs[0].token_ids
    assert not any(tuple(outputs[i:i + len(alone)]) == alone for i in range(len(outputs)))


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm: LLM) -> None:
    long = list(range(5, 45))
    (truncated,) = llm.generate({"prompt_token_ids": long},
                                SamplingParams(temperature=0, max_tokens=MAX_NEW, truncate_prompt_tokens=12),
                                use_tqdm=False)
    assert truncated.prompt_token_ids == long[-12:]
    assert truncated.outputs[0].token_ids == generate(llm, [long[-12:]])[0]
    (text,) = llm.generate("a prompt " * 10, SamplingParams(max_tokens=1, truncate_prompt_tokens=4), use_tqdm=False)
    assert len(text.prompt_token_ids) == 4 and text.prompt is None  # its text is no longer what was tokenized
    # longer than any context could hold: refused before it is tokenized, unless it is to be cut
    huge = "a prompt " * (10 * llm.engine.max_model_len)
    with pytest.raises(ValueError, match="more tokens than max_model_len"):
        llm.generate(huge, SamplingParams(max_tokens=1), use_tqdm=False)
    (cut,) = llm.generate(huge, SamplingParams(max_tokens=1, truncate_prompt_tokens=8), use_tqdm=False)
    assert cut.prompt_token_ids == llm.get_tokenizer().encode(huge)[-8:]


def test_bad_words_and_their_token_ids_are_both_banned_and_a_contradiction_gives_way(llm: LLM) -> None:
    free = generate(llm, PROMPTS[:1])[0]
    word = llm.get_tokenizer().decode(free[:1]).strip()
    both = generate(llm, PROMPTS[:1], bad_words=[word], bad_words_token_ids=[free[1:3]])[0]
    spelled = llm.get_tokenizer().encode(word, add_special_tokens=False)
    assert not any(both[i:i + len(spelled)] == spelled for i in range(len(both)))
    assert not any(both[i:i + 2] == free[1:3] for i in range(len(both)))
    # a two-token word ending on the one allowed token: its ban gives way (it drew token 0, outside both)
    assert generate(llm, PROMPTS[:1], allowed_token_ids=[9], bad_words_token_ids=[[9, 9]])[0] == [9] * MAX_NEW


@pytest.mark.parametrize("params, message", [
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[1, 10**9]]}, "bad_words_token_ids"),
    ({"truncate_prompt_tokens": -1, "max_tokens": 1}, "leaves no room"),
    ({"allowed_token_ids": [5, 6], "bad_words_token_ids": [[6], [5], [7, 5]]}, "nothing is left to draw"),
])
def test_restrictions_outside_the_model_are_refused(llm: LLM, params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_token_ids": list(range(3, 3 + llm.engine.max_model_len + 5))}
                     if params.get("truncate_prompt_tokens") else "hi", SamplingParams(**params), use_tqdm=False)
    assert_all_blocks_free(llm)
