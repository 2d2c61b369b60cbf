"""The n-gram proposer: the longest matching suffix wins, then the most recent occurrence."""

from __future__ import annotations

import numpy as np

from kvserve.spec.ngram import propose_ngram


def propose(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 3) -> list[int]:
    return propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def test_proposes_the_tokens_after_the_earlier_occurrence_of_the_suffix() -> None:
    assert propose([1, 2, 3, 9, 8, 7, 6, 1, 2, 3]) == [9, 8, 7]
    assert propose([1, 2, 3, 9, 8, 1, 2, 3], k=5) == [9, 8, 1, 2, 3]


def test_the_longest_n_gram_wins_over_a_more_recent_shorter_one() -> None:
    # "2 3" ends at index 2 (followed by 7); only "3" ends at index 5 (followed by 5)
    assert propose([1, 2, 3, 7, 4, 3, 5, 1, 2, 3], k=1) == [7]


def test_among_equally_long_matches_the_most_recent_wins() -> None:
    assert propose([1, 2, 5, 1, 2, 6, 1, 2], max_n=2, k=1) == [6]


def test_nothing_below_min_n_or_without_a_match() -> None:
    assert propose([1, 2, 3, 4]) == []
    assert propose([5, 3, 9, 3], min_n=2) == []  # only a 1-gram matches
    assert propose([7]) == []
    assert propose([1, 2, 1, 2], k=0) == []


def test_a_match_near_the_end_repeats_with_its_period() -> None:
    assert propose([4, 4, 4, 4], k=3) == [4, 4, 4]
    assert propose([1, 2, 1, 2, 1, 2], max_n=2, k=5) == [1, 2, 1, 2, 1]
    assert propose([9, 1, 2, 3, 1, 2, 3], k=4) == [1, 2, 3, 1]


def test_a_match_of_exactly_max_n_tokens_counts_as_the_longest() -> None:
    # "1 2 3" (3 = max_n tokens) ends at index 2, followed by 9; "2 3" alone ends later, at index 6, followed by 8
    assert propose([1, 2, 3, 9, 5, 2, 3, 8, 7, 1, 2, 3], max_n=3, k=2) == [9, 5]
    assert propose([1, 2, 3, 9, 5, 2, 3, 8, 7, 1, 2, 3], max_n=2, k=2) == [8, 7]


def test_the_proposer_follows_a_growing_history_as_proposing_on_it_whole_does() -> None:
    """The proposer keeps each request's history as an array grown as outputs come (the whole output list was
    converted at every step: 75% of a proposal at 16k outputs); its drafts are those of the whole history."""
    from kvserve.request import Request
    from kvserve.sampling_params import SamplingParams
    from kvserve.spec.ngram import NgramProposer

    rng = np.random.default_rng(0)
    request = Request("r", [int(t) for t in rng.integers(0, 4, 5)], SamplingParams(max_tokens=500))
    proposer = NgramProposer(1, 3)
    for _ in range(300):  # past the array's first capacity (64, twice the prompt) more than once
        history = request.prompt_token_ids + request.output_token_ids
        assert list(proposer.propose(request, 3)) == propose(history, 1, 3, 3)
        request.output_token_ids.extend(int(t) for t in rng.integers(0, 4, int(rng.integers(1, 3))))
    proposer.drop("r")
    assert list(proposer.propose(request, 3)) == propose(request.prompt_token_ids + request.output_token_ids)
