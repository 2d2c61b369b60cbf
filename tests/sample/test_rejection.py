"""Draft verification: greedy keeps the argmax exactly; sampled rows emit exactly the target's distribution."""

from __future__ import annotations

import torch
from scipy import stats

from kvserve.sample.rejection import accept_greedy, accept_sampled


def test_greedy_accepts_the_matching_prefix_then_emits_the_target_token() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all accepted: the bonus token


def _emitted_counts(probs: torch.Tensor, draft: list[int], num_trials: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token is emitted first, and second when the first draft was accepted."""
    generator = torch.Generator().manual_seed(0)
    vocab = probs.shape[1]
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(num_trials):
        tokens = accept_sampled(probs, draft, generator)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


def test_sampled_verification_emits_the_target_distribution_chi_square() -> None:
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0])
    p1 = torch.tensor([0.25, 0.05, 0.3, 0.1, 0.3])
    probs = torch.stack([p0, p1])
    first, second = _emitted_counts(probs, draft=[3], num_trials=6000)
    for observed, p in ((first, p0), (second, p1)):
        support = p > 0
        assert observed[~support].sum() == 0  # a token of probability 0 is never emitted
        expected = p[support] * observed.sum()
        assert stats.chisquare(observed[support].numpy(), expected.numpy()).pvalue > 1e-3
    assert abs(second.sum() / 6000 - 0.3) < 0.03  # the draft token is accepted with probability p0(3)


def test_a_draft_of_probability_zero_is_always_rejected_and_never_emitted() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    first, second = _emitted_counts(probs, draft=[2], num_trials=200)
    assert first[2] == 0 and second.sum() == 0


def test_the_same_seed_gives_the_same_tokens() -> None:
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    runs = [accept_sampled(probs, [3, 7, 9], torch.Generator().manual_seed(5)) for _ in range(2)]
    assert runs[0] == runs[1]
