"""Schemas the grammar cannot hold the output to are refused by keyword and place; an integer's exclusive bounds
become inclusive ones; property names are names, never keywords."""

from __future__ import annotations

import pytest

from kvserve.sample.json_schema import UNENFORCED_KEYWORDS, enforceable_schema

OBJ = "object"


@pytest.mark.parametrize("keyword", sorted(UNENFORCED_KEYWORDS - {"exclusiveMinimum", "exclusiveMaximum"}))
def test_every_unenforced_keyword_is_refused_where_it_stands(keyword: str) -> None:
    schema = {"type": OBJ, "properties": {"tags": {"type": "array", keyword: True}}}
    with pytest.raises(ValueError, match=f"uses '{keyword}' at #/properties/tags, which structured output"):
        enforceable_schema(schema)


def test_exclusive_bounds_of_a_number_are_refused_and_of_an_integer_made_inclusive() -> None:
    with pytest.raises(ValueError, match="'exclusiveMinimum' at #/items"):
        enforceable_schema({"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}})
    integer = {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10.0, "minimum": 3}
    assert enforceable_schema(integer) == {"type": "integer", "minimum": 3, "maximum": 9}
    assert integer["exclusiveMinimum"] == 0  # the caller's schema is left as it was


def test_a_reference_outside_the_schema_and_an_unlisted_required_key_are_refused() -> None:
    with pytest.raises(ValueError, match="refers to 'https://example.com/s.json' at #/properties/a"):
        enforceable_schema({"type": OBJ, "properties": {"a": {"$ref": "https://example.com/s.json"}}})
    with pytest.raises(ValueError, match="requires 'b' at # without listing it under properties"):
        enforceable_schema({"type": OBJ, "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]})


def test_names_and_data_are_never_taken_for_keywords() -> None:
    schema = {"type": OBJ, "properties": {"not": {"type": "integer"}, "if": {"enum": ["allOf", {"not": 1}]}},
              "required": ["not", "if"], "$defs": {"contains": {"const": {"uniqueItems": True}}},
              "description": "allOf the things"}
    assert enforceable_schema(schema) == schema
