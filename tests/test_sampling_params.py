"""SamplingParams and StructuredOutputsParams refuse values of the wrong range or type by name."""

from __future__ import annotations

import pytest

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams


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
])
def test_a_constraint_of_the_wrong_type_is_refused_by_name(fields: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        StructuredOutputsParams(**fields)


def test_a_choice_list_becomes_a_tuple() -> None:
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
