"""SamplingParams and StructuredOutputsParams refuse values of the wrong range or type by name."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("penalty", [0.0, 1e-300, 1e-7, 2e6])
def test_repetition_penalty_outside_its_range_is_refused(penalty: float) -> None:
    with pytest.raises(ValueError, match=r"repetition_penalty must be in \[1e-06, 1e\+06\]"):
        SamplingParams(repetition_penalty=penalty)


@pytest.mark.parametrize("fields, fragment", [
    (dict(regex=5), "regex must be a string, got int"),
    (dict(grammar=["root ::= x"]), "grammar must be a string, got list"),
    (dict(json=3.5), "json must be a JSON schema"),
    (dict(json_object="yes"), "json_object must be true or false"),
    (dict(choice="ab"), "choice must be a list of strings, got str"),
    (dict(choice=["a", 1]), "choice must be a non-empty list of non-empty strings"),
    (dict(regex="a", begins_after_token_id="</think>"), "begins_after_token_id must be an integer, got str"),
])
def test_a_constraint_of_the_wrong_type_is_refused_by_name(fields: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        StructuredOutputsParams(**fields)


def test_a_choice_list_becomes_a_tuple() -> None:
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")


@pytest.mark.parametrize("fields, fragment", [
    (dict(n=1.5), "n must be an integer, got float"),
    (dict(n=True), "n must be an integer, got bool"),
    (dict(temperature="0"), "temperature must be a number, got str"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
    (dict(max_tokens=3.5), "max_tokens must be an integer, got float"),
    (dict(seed="x"), "seed must be an integer, got str"),
    (dict(seed=2**63), "seed must be a 64-bit signed integer, got 9223372036854775808"),
    (dict(stop="x" * 1025), "a stop string has at most 1024 characters"),
    (dict(stop_token_ids=list(range(1025))), "stop_token_ids takes at most 1024 distinct ids, got 1025"),
    (dict(seed=-(2**63) - 1), "seed must be a 64-bit signed integer"),
    (dict(logprobs=True), "logprobs must be an integer, got bool"),
    (dict(logprobs=-2), r"logprobs must be -1 \(the whole vocabulary\) or >= 0, got -2"),
    (dict(prompt_logprobs=-5), r"prompt_logprobs must be -1 \(the whole vocabulary\) or >= 0, got -5"),
    (dict(ignore_eos="no"), "ignore_eos must be true or false, got str"),
    (dict(stop=5), "stop must be a string or a list of strings, got int"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids, got int"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict of token id to bias, got list"),
    (dict(logit_bias={"a": 1.0}), "logit_bias: key 'a' is not a token id"),
    (dict(logit_bias={"9" * 5000: 1.0}), "logit_bias: key '9999999999999999999999999999999999999999' is not a token id"),
    (dict(logit_bias={9: float("nan")}), "the bias of token 9 must be a finite number"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias takes at most 300 tokens, got 301"),
    (dict(structured_outputs={"json": {}}), "structured_outputs must be a StructuredOutputsParams, got dict"),
])
def test_a_field_of_the_wrong_type_is_refused_by_name_at_construction(fields: dict, fragment: str) -> None:
    (name,) = fields
    with pytest.raises(InvalidParameter, match=fragment) as raised:
        SamplingParams(**fields)
    assert raised.value.param == name


def test_numbers_of_other_numeric_types_become_pythons_own() -> None:
    params = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), stop_token_ids=[np.int64(3)],
                            logit_bias={np.int64(4): 1, "5": np.float64(-2.0)}, seed=np.int64(2**62))
    assert type(params.n) is int and type(params.temperature) is float and params.stop_token_ids == [3]
    assert type(params.seed) is int
    assert params.logit_bias == {4: 1.0, 5: -2.0} and all(type(k) is int for k in params.logit_bias)


def test_stop_token_ids_are_kept_once_each() -> None:
    """Checked against every token of every sample: 2,000,000 copies of one id are one id."""
    assert SamplingParams(stop_token_ids=[9] * 2_000_000 + [3, 9]).stop_token_ids == [9, 3]
