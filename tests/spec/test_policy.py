"""SpeculationPolicy: who speculates, how many tokens, and the counters."""

from __future__ import annotations

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.spec.policy import MAX_RUNNING_TO_SPECULATE, SpeculationPolicy
from kvserve.spec.proposer import DRAFT_SLOT

REPEATING = [1, 2, 3, 4, 5, 6] * 3


def policy(k: int = 4) -> SpeculationPolicy:
    return SpeculationPolicy(SpeculativeConfig("ngram", k, 1, 3))


def request(**params) -> Request:
    return Request("r", REPEATING, SamplingParams(temperature=0, **params))


def test_a_repeating_request_proposes_k_tokens_within_the_limit() -> None:
    assert policy().draft(request(), num_running=1, max_draft=10) == (1, 2, 3, 4)
    assert policy().draft(request(), num_running=1, max_draft=2) == (1, 2)
    assert policy().draft(request(), num_running=1, max_draft=0) == ()


def test_no_speculation_in_a_busy_step() -> None:
    assert policy().draft(request(), num_running=MAX_RUNNING_TO_SPECULATE + 1, max_draft=10) == ()


def test_speculation_at_the_running_limit_itself() -> None:
    """The limit is the most running requests that still speculate."""
    assert policy().draft(request(), num_running=MAX_RUNNING_TO_SPECULATE, max_draft=10) == (1, 2, 3, 4)


@pytest.mark.parametrize(
    "params",
    [{"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"min_tokens": 2},
     {"logit_bias": {3: 1.0}}, {"logprobs": 1}, {"prompt_logprobs": 1}, {"n": 2},
     {"min_tokens": 2, "ignore_eos": True, "stop_token_ids": [7]},
     {"structured_outputs": StructuredOutputsParams(regex="[0-9]+")}],
)
def test_requests_whose_sampling_reads_the_history_speculate(params) -> None:
    """The sampler verifies each draft position with its own history (``SamplingBatch.of_requests``), and the
    grammar masks it with its matcher walked along the draft."""
    assert policy().draft(request(**params), num_running=1, max_draft=10) == (1, 2, 3, 4)


def test_a_low_acceptance_rate_lowers_k_then_stops_then_probes_again() -> None:
    spec = policy(k=4)
    spec.record("r", num_draft=4, num_emitted=1)  # rate 1 -> 0.5
    assert len(spec.draft(request(), 1, 10)) == 2
    spec.record("r", num_draft=2, num_emitted=1)  # -> 0.25
    spec.record("r", num_draft=1, num_emitted=1)  # -> 0.125: stops
    assert spec.draft(request(), 1, 10) == ()
    drafts = [spec.draft(request(), 1, 10) for _ in range(10)]
    assert drafts[-1] != ()  # the rate crept back over the floor


def test_stats_count_drafted_accepted_and_emitted_tokens() -> None:
    spec = policy()
    spec.record("r", 4, 3)
    spec.record("r", 2, 3)
    assert spec.stats() == {
        "spec_decode_num_draft_tokens": 6,
        "spec_decode_num_accepted_tokens": 4,
        "spec_decode_num_emitted_tokens": 6,
        "spec_decode_acceptance_rate": 4 / 6,
    }


def test_the_draft_method_reserves_slots_for_the_runner() -> None:
    spec = SpeculationPolicy(SpeculativeConfig("draft", 3, model="draft-model"))
    assert spec.draft(request(), num_running=1, max_draft=10) == (DRAFT_SLOT,) * 3
    assert spec.draft(request(), num_running=1, max_draft=2) == (DRAFT_SLOT,) * 2
    assert spec.draft(request(), num_running=MAX_RUNNING_TO_SPECULATE + 1, max_draft=10) == ()
    spec.record("r", num_draft=3, num_emitted=1)  # nothing accepted: k follows the acceptance rate down
    assert len(spec.draft(request(), num_running=1, max_draft=10)) == 2
