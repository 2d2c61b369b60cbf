"""Schemas the grammar cannot hold the output to are refused by keyword and place (what xgrammar does enforce is
let through); property and definition names are names, never keywords."""

from __future__ import annotations

import json

import pytest

from kvserve.sample.json_schema import UNENFORCED_KEYWORDS, check_enforceable

OBJ = "object"


@pytest.mark.parametrize("keyword", sorted(UNENFORCED_KEYWORDS))
def test_every_unenforced_keyword_is_refused_where_it_stands(keyword: str) -> None:
    schema = {"type": OBJ, "properties": {"tags": {"type": "array", keyword: True}}}
    with pytest.raises(ValueError, match=f"uses '{keyword}' at #/properties/tags, which structured output"):
        check_enforceable(schema)


def test_a_fractional_multiple_is_refused_and_an_integers_and_the_bounds_are_not() -> None:
    with pytest.raises(ValueError, match="'multipleOf' at #/items"):
        check_enforceable({"type": "array", "items": {"type": "number", "multipleOf": 0.5}})
    check_enforceable({"type": "integer", "multipleOf": 5, "exclusiveMinimum": 0, "exclusiveMaximum": 100})
    check_enforceable({"type": "number", "exclusiveMinimum": 0.5, "maximum": 10})


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}, "'maxLength' beside 'pattern'"),
    ({"type": "string", "format": "date", "minLength": 30}, "'minLength' beside 'format'"),
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, "'maxLength' beside 'enum'"),
    ({"const": "abc", "pattern": "^x"}, "'pattern' beside 'const'"),
])
def test_a_constraint_the_grammar_drops_for_another_beside_it_is_refused(schema: dict, named: str) -> None:
    """pydantic's ``Field(pattern=..., max_length=...)`` writes the first: its answers broke the length."""
    with pytest.raises(ValueError, match=f"uses {named} at #/properties/s, which structured output"):
        check_enforceable({"type": OBJ, "properties": {"s": schema}})
    check_enforceable({"type": "string", "pattern": "^[a-z]+$"})
    check_enforceable({"type": "string", "maxLength": 5, "minLength": 1})
    check_enforceable({"type": "string", "enum": ["a", "b"], "title": "Letter", "description": "one of two"})


def test_a_reference_outside_the_schema_and_an_unlisted_required_key_are_refused() -> None:
    with pytest.raises(ValueError, match="refers to 'https://example.com/s.json' at #/properties/a"):
        check_enforceable({"type": OBJ, "properties": {"a": {"$ref": "https://example.com/s.json"}}})
    with pytest.raises(ValueError, match="requires 'b' at # without listing it under properties"):
        check_enforceable({"type": OBJ, "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]})


def test_names_and_data_are_never_taken_for_keywords() -> None:
    check_enforceable({"type": OBJ, "properties": {"not": {"type": "integer"}, "if": {"enum": ["allOf", {"not": 1}]}},
                       "required": ["not", "if"], "$defs": {"contains": {"const": {"uniqueItems": True}}},
                       "description": "allOf the things"})


def test_what_is_refused_is_what_the_grammar_lets_through(tiny_checkpoints) -> None:
    """The measurement behind the lists, on this xgrammar: a document counts as admitted where the matcher takes it
    and then completes. Should xgrammar come to enforce a refused keyword, this says so."""
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                                   stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgrammar.GrammarCompiler(info)

    def admits(schema: dict, document: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        return matcher.accept_string(document) and matcher.is_completed()

    assert admits({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]")
    assert admits({"not": {"const": 0}}, "0")
    assert admits({"type": "number", "multipleOf": 0.5}, "0.3")
    assert not admits({"type": "integer", "multipleOf": 5}, "12")
    assert admits({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"')
    assert admits({"type": "string", "enum": ["a", "b"], "maxLength": 0}, '"a"')
    assert admits({"const": "abc", "pattern": "^x"}, '"abc"')
    assert not admits({"type": "string", "maxLength": 3}, '"abcdef"')
    assert not admits({"type": "number", "exclusiveMinimum": 5}, "5") and admits({"type": "number",
                                                                                   "exclusiveMinimum": 5}, "6")
