"""Each logits processor against a hand computation on small logits."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.sample.logits_processors import (
    apply_history_processors,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_top_k_top_p,
    token_counts,
)
from kvserve.sample.metadata import SamplingRow
from kvserve.sampling_params import SamplingParams

INF = float("inf")


def row(prompt=(), outputs=(), eos=frozenset(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), 0, "r", list(prompt), list(outputs), frozenset(eos))


def test_logit_bias_adds_per_row():
    logits = torch.zeros(2, 4)
    apply_logit_bias(logits, [row(logit_bias={1: 2.5, 3: -1.0}), row()])
    assert logits.tolist() == [[0, 2.5, 0, -1.0], [0, 0, 0, 0]]


def test_logit_bias_outside_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        apply_logit_bias(torch.zeros(1, 4), [row(logit_bias={9: 1.0})])


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, 5)
    rows = [
        row(outputs=[4], eos={0}, min_tokens=2, stop_token_ids=[3]),  # 1 output < 2: banned
        row(outputs=[4, 4], eos={0}, min_tokens=2, stop_token_ids=[3]),  # reached: untouched
        row(outputs=[], eos={0}, min_tokens=1, ignore_eos=True),  # EOS ignored anyway: nothing to ban
    ]
    apply_min_tokens(logits, rows)
    assert logits[0].tolist() == [-INF, 0, 0, -INF, 0]
    assert logits[1].tolist() == [0] * 5
    assert logits[2].tolist() == [0] * 5


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0], [2.0, -2.0, 3.0, -1.0]])
    apply_repetition_penalty(logits, [row(prompt=[0], outputs=[1, 1], repetition_penalty=2.0), row()])
    assert logits[0].tolist() == [1.0, -4.0, 3.0, -1.0]
    assert logits[1].tolist() == [2.0, -2.0, 3.0, -1.0]


def test_presence_and_frequency_penalties_count_outputs_only():
    logits = torch.zeros(1, 4)
    apply_presence_frequency_penalties(
        logits, [row(prompt=[3, 3], outputs=[1, 1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)]
    )
    assert logits[0].tolist() == pytest.approx([0.0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0.0])


def test_history_processors_run_in_vllm_order():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    r = row(prompt=[0], outputs=[2], eos={3}, min_tokens=5, logit_bias={0: -3.0, 2: 1.0},
            repetition_penalty=2.0, presence_penalty=0.5)
    apply_history_processors(logits, [r])
    # bias: [-2, 1, 2, 1]; min_tokens bans 3; repetition over {0, 2}: [-4, 1, 1, -inf]; presence on 2: 0.5
    assert logits[0].tolist() == [-4.0, 1.0, 0.5, -INF]


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


def test_min_p_masks_below_a_fraction_of_the_top_probability():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    apply_min_p(logits, torch.tensor([0.2]))  # threshold 0.1
    assert torch.isfinite(logits).tolist() == [[True, True, True, False]]
    assert logits[0, :3].tolist() == pytest.approx([math.log(0.5), math.log(0.3), math.log(0.15)])
