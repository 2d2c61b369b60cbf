"""Each logits processor against a hand computation on small logits and a plain per-row reference on random
ones; the penalties' counts on the device through their lifecycle; truncation against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sample.logits_processors import LogitBias, MinTokensBan, default_processors
from kvserve.sample.restrictions import AllowedTokens, BadWords
from kvserve.sample.metadata import SamplingRow
from kvserve.sample.penalties import Penalties
from kvserve.sample.processor import LogitsProcessor, token_counts
from kvserve.sample import truncation
from kvserve.sample.truncation import apply_min_p, apply_top_k_top_p
from kvserve.sampling_params import SamplingParams

INF = float("inf")
VOCAB = 8


def row(prompt=(), outputs=(), eos=frozenset(), key="r", **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), 0, key, list(prompt), list(outputs), frozenset(eos))


def run(processor: LogitsProcessor, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """``apply`` as the sampler calls it: a stateful processor first meets each new sample's first row."""
    if processor.is_stateful:
        for r in rows:
            processor.add(r.generator_key, r)
    processor.apply(logits, rows)


def test_logit_bias_adds_per_row():
    logits = torch.zeros(2, 4)
    LogitBias().apply(logits, [row(logit_bias={1: 2.5, 3: -1.0}), row()])
    assert logits.tolist() == [[0, 2.5, 0, -1.0], [0, 0, 0, 0]]


def test_logit_bias_outside_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        LogitBias().apply(torch.zeros(1, 4), [row(logit_bias={9: 1.0})])


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, 5)
    rows = [
        row(outputs=[4], eos={0}, min_tokens=2, stop_token_ids=[3]),  # 1 output < 2: banned
        row(outputs=[4, 4], eos={0}, min_tokens=2, stop_token_ids=[3]),  # reached: untouched
        row(outputs=[], eos={0}, min_tokens=1, ignore_eos=True),  # EOS ignored anyway: nothing to ban
    ]
    MinTokensBan().apply(logits, rows)
    assert logits[0].tolist() == [-INF, 0, 0, -INF, 0]
    assert logits[1].tolist() == [0] * 5
    assert logits[2].tolist() == [0] * 5


def test_min_tokens_gives_way_where_a_grammar_allows_nothing_else():
    """A constraint that allows only its end (EOS) before min_tokens: the ban left a row of -inf, whose draw was
    token 0, outside the grammar ("ab<|pad|><|pad|>" for choice "ab" with min_tokens 4)."""
    logits = torch.tensor([[-INF, -INF, 1.5, -INF], [0.0, 1.0, 2.0, 3.0]])  # row 0: only EOS (2) allowed
    MinTokensBan().apply(logits, [row(outputs=[1], eos={2}, min_tokens=4, stop_token_ids=[3]),
                                  row(outputs=[1], eos={2}, min_tokens=4, stop_token_ids=[3])])
    assert logits[0].tolist() == [-INF, -INF, 1.5, -INF]  # stop token 3 was -inf already
    assert logits[1].tolist() == [0.0, 1.0, -INF, -INF]  # other tokens left: banned as before


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0], [2.0, -2.0, 3.0, -1.0]])
    run(Penalties(), logits, [row(prompt=[0], outputs=[1, 1], repetition_penalty=2.0), row(key="s")])
    assert logits[0].tolist() == [1.0, -4.0, 3.0, -1.0]
    assert logits[1].tolist() == [2.0, -2.0, 3.0, -1.0]


def test_presence_and_frequency_penalties_count_outputs_only():
    logits = torch.zeros(1, 4)
    run(Penalties(), logits, [row(prompt=[3, 3], outputs=[1, 1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)])
    assert logits[0].tolist() == pytest.approx([0.0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0.0])


@pytest.mark.parametrize("processor, params", [
    (AllowedTokens, [{"allowed_token_ids": [5]}, {"allowed_token_ids": [5, 6]}]),
    (BadWords, [{"bad_words_token_ids": [[3], [1, 2, 3]]}] * 2),
])
def test_a_restriction_gives_way_where_it_would_leave_nothing_to_draw(processor, params) -> None:
    """Another restriction (a grammar, here by hand) left token 3 alone in the first row: restricting it away too
    drew token 0, outside both. The second row keeps token 6 as well: the restriction holds there."""
    logits = torch.full((2, VOCAB), -INF)
    logits[:, 3] = 1.0
    logits[1, 6] = 2.0
    before = logits.clone()
    run(processor(), logits, [row(outputs=[1, 2], key=f"r{i}", **p) for i, p in enumerate(params)])
    assert torch.equal(logits[0], before[0])
    assert [t for t in range(VOCAB) if logits[1, t] > -INF] == [6] and logits[1, 6] == 2.0


def test_history_processors_run_in_vllm_order():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    r = row(prompt=[0], outputs=[2], eos={3}, min_tokens=5, logit_bias={0: -3.0, 2: 1.0},
            repetition_penalty=2.0, presence_penalty=0.5)
    processors = default_processors()
    assert [type(p) for p in processors] == [AllowedTokens, LogitBias, BadWords, MinTokensBan, Penalties]
    for processor in processors:
        run(processor, logits, [r])
    # bias: [-2, 1, 2, 1]; min_tokens bans 3; repetition over {0, 2}: [-4, 1, 1, -inf]; presence on 2: 0.5
    assert logits[0].tolist() == [-4.0, 1.0, 0.5, -INF]


tokens = st.integers(0, VOCAB - 1)


@st.composite
def random_rows(draw) -> list[SamplingRow]:
    """1-5 rows with any mix of bias, min_tokens, stop tokens and penalties; histories as lists or arrays."""
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        params = SamplingParams(
            logit_bias=draw(st.dictionaries(tokens, st.sampled_from([-5.0, -0.5, 1.5]), max_size=3)),
            min_tokens=draw(st.integers(0, 3)),
            stop_token_ids=draw(st.lists(tokens, max_size=2)),
            ignore_eos=draw(st.booleans()),
            repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.3, 2.0])),
            presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.25, -0.5])),
            allowed_token_ids=draw(st.none() | st.lists(tokens, min_size=1, max_size=4)),
            bad_words_token_ids=draw(st.none() | st.lists(st.lists(tokens, min_size=1, max_size=3), max_size=3)),
        )
        prompt, outputs = draw(st.lists(tokens, max_size=6)), draw(st.lists(tokens, max_size=5))
        if draw(st.booleans()):
            prompt, outputs = np.array(prompt, dtype=np.int64), np.array(outputs, dtype=np.int32)
        rows.append(SamplingRow(params, 0, f"r{len(rows)}", prompt, outputs,
                                frozenset(draw(st.sets(tokens, max_size=2)))))
    return rows


def reference_row(processor: type, logits: list[float], r: SamplingRow) -> list[float]:
    """One row by the definitions, token by token in plain Python."""
    p, out = r.params, list(r.output_token_ids)
    if processor is LogitBias:
        return [x + (p.logit_bias or {}).get(t, 0.0) for t, x in enumerate(logits)]
    if processor is AllowedTokens:
        allowed = range(VOCAB) if p.allowed_token_ids is None else p.allowed_token_ids
        return [x if t in allowed else -INF for t, x in enumerate(logits)]
    if processor is BadWords:
        banned = {word[-1] for word in p.bad_words_token_ids or () if len(word) == 1 or
                  out[-(len(word) - 1):] == list(word[:-1])}
        return [-INF if t in banned else x for t, x in enumerate(logits)]
    if processor is MinTokensBan:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        return [-INF if len(out) < p.min_tokens and t in banned else x for t, x in enumerate(logits)]
    seen = set(list(r.prompt_token_ids) + out)
    pen = p.repetition_penalty
    logits = [(x / pen if x > 0 else x * pen) if t in seen else x for t, x in enumerate(logits)]
    return [x - p.frequency_penalty * out.count(t) - p.presence_penalty * (t in out) for t, x in enumerate(logits)]


@pytest.mark.parametrize("processor", [AllowedTokens, LogitBias, BadWords, MinTokensBan, Penalties])
@settings(max_examples=50, deadline=None)
@given(rows=random_rows(), seed=st.integers(0, 2**16))
def test_processor_matches_a_per_row_reference(processor: type, rows: list[SamplingRow], seed: int) -> None:
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    expected = [reference_row(processor, logits[i].tolist(), r) for i, r in enumerate(rows)]
    untouched = [i for i, r in enumerate(rows) if not processor().is_needed(r)]
    before = logits.clone()
    run(processor(), logits, rows)
    torch.testing.assert_close(logits, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert torch.equal(logits[untouched], before[untouched])  # rows that need nothing stay bit for bit


def test_token_counts():
    counts = token_counts([[1, 1, 3], []], 4, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0]]


def test_top_k_keeps_the_k_largest_and_zero_disables():
    logits = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.1, 0.4, 0.3, 0.2]])
    apply_top_k_top_p(logits, torch.tensor([2, 0]), None)
    assert logits[0].tolist() == pytest.approx([-INF, 0.4, 0.3, -INF])
    assert logits[1].tolist() == pytest.approx([0.1, 0.4, 0.3, 0.2])


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]] * 3)
    logits = probs.log()
    apply_top_k_top_p(logits, None, torch.tensor([0.7, 0.4, 1.0]))
    kept = torch.isfinite(logits).tolist()
    assert kept[0] == [False, True, False, True]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert kept[1] == [False, True, False, False]  # 0.5 alone reaches 0.4
    assert kept[2] == [True] * 4


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    # top-2 renormalised: 0.5/0.8 = 0.625, 0.3/0.8 = 0.375; top_p 0.6 keeps only the first
    apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isfinite(logits).tolist() == [[False, True, False, False]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cpus_cut_off_values_keep_what_the_whole_sort_keeps(seed: int) -> None:
    """Rows with a top-k, a top-p, both or neither, peaked and flat, no ties: the same kept sets, values
    unchanged."""
    rng = torch.Generator().manual_seed(seed)
    for case in range(40):
        num_rows, vocab_size = 6, 64
        logits = torch.randn(num_rows, vocab_size, generator=rng) * (8.0 if case % 2 else 0.3)
        top_k = torch.tensor([0, 3, 0, 20, 1, 0])[torch.randperm(num_rows, generator=rng)]
        top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.3, 0.95])[torch.randperm(num_rows, generator=rng)]
        for k, p in ((top_k, None), (None, top_p), (top_k, top_p)):
            expected = logits.clone()
            truncation._truncate_by_sort(expected, k, p)
            actual = logits.clone()
            truncation._truncate_by_threshold(actual, k, p)
            assert torch.equal(torch.isfinite(actual), torch.isfinite(expected))
            assert torch.equal(actual[torch.isfinite(actual)], logits[torch.isfinite(actual)])


@pytest.mark.parametrize("cut", [truncation._truncate_by_sort, truncation._truncate_by_threshold])
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p_exactly(cut) -> None:
    """At the boundary: a mass of exactly top_p before a token drops it (vLLM's smallest set reaching p)."""
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.5, 0.125, 0.125]]).log()
    cut(logits, None, torch.tensor([0.5, 0.75]))
    assert torch.isfinite(logits).tolist() == [[True, False, False, False], [True, True, False, False]]


def test_the_cpus_top_p_keeps_every_token_tied_with_the_last_it_keeps() -> None:
    """Where the whole sort keeps the tied tokens it happened to put first, the cut-off value keeps them all."""
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.2]]).log()
    truncation._truncate_by_threshold(logits, None, torch.tensor([0.5]))
    assert torch.isfinite(logits).tolist() == [[True, True, True, True]]
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]).log()
    truncation._truncate_by_threshold(logits, torch.tensor([4]), torch.tensor([0.5]))
    assert torch.isfinite(logits).tolist() == [[True, True, True, False, False]]


def test_min_p_masks_below_a_fraction_of_the_top_probability():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    apply_min_p(logits, torch.tensor([0.2]))  # threshold 0.1
    assert torch.isfinite(logits).tolist() == [[True, True, True, False]]
    assert logits[0, :3].tolist() == pytest.approx([math.log(0.5), math.log(0.3), math.log(0.15)])


def test_min_p_keeps_a_token_exactly_at_the_threshold() -> None:
    """vLLM masks ``probs < min_p * max``: 0.25 is exactly half of 0.5, so min_p 0.5 keeps it."""
    logits = torch.tensor([[0.25, 0.5, 0.25]]).log()
    apply_min_p(logits, torch.tensor([0.5]))
    assert torch.isfinite(logits).tolist() == [[True, True, True]]


def test_min_p_of_one_keeps_the_most_likely_tokens_and_their_ties() -> None:
    logits = torch.tensor([[0.2, 0.4, 0.4], [0.25, 0.5, 0.25]]).log()
    apply_min_p(logits, torch.tensor([1.0, 1.0]))
    assert torch.isfinite(logits).tolist() == [[False, True, True], [False, True, False]]
