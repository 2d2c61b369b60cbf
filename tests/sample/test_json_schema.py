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
    ({"type": "string", "format": "date", "pattern": "^2"}, "'pattern' beside 'format'"),
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, "'maxLength' beside 'enum'"),
    ({"const": "abc", "pattern": "^x"}, "'pattern' beside 'const'"),
    ({"type": "string", "enum": ["a", 1]}, "'type' beside 'enum'"),
    ({"type": "string", "const": 1}, "'type' beside 'const'"),
    ({"$ref": "#/$defs/P", "minimum": 1000}, "'minimum' beside '\\$ref'"),
    ({"$ref": "#/$defs/P", "required": ["a"]}, "'required' beside '\\$ref'"),
    ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 0}]}, "'type' beside 'anyOf'"),
    ({"type": "integer", "oneOf": [{"minimum": 5}, {"maximum": 0}]}, "'type' beside 'oneOf'"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' \\(its branches can match together\\)"),
    ({"oneOf": [{"type": "object"}, {"type": "object"}]}, "'oneOf' \\(its branches can match together\\)"),
    ({"type": "string", "pattern": "^(?!a)[a-c]{1,3}$"}, "a lookaround in 'pattern'"),
    ({"type": "string", "pattern": "(?<=x)y"}, "a lookaround in 'pattern'"),
])
def test_a_constraint_the_grammar_drops_for_another_beside_it_is_refused(schema: dict, named: str) -> None:
    """pydantic's ``Field(pattern=..., max_length=...)`` writes the first: its answers broke the length."""
    with pytest.raises(ValueError, match=f"uses {named} at #/properties/s, which structured output"):
        check_enforceable({"type": OBJ, "properties": {"s": schema}})
    check_enforceable({"type": "string", "pattern": "^[a-z]+$"})
    check_enforceable({"type": "string", "maxLength": 5, "minLength": 1})
    check_enforceable({"type": "string", "enum": ["a", "b"], "title": "Letter", "description": "one of two"})
    check_enforceable({"type": "integer", "enum": [1, 2.0]})
    check_enforceable({"type": "string", "pattern": "^\\(?=x$"})  # an escaped parenthesis is no lookaround


def test_annotations_beside_a_reference_or_a_composition_and_disjoint_one_ofs_are_let_through() -> None:
    """What pydantic writes: a reference with its description, an optional field's anyOf with a default, a
    discriminated union's oneOf of references whose one required property holds a distinct const each."""
    definitions = {"Cat": {"type": OBJ, "properties": {"kind": {"const": "cat"}, "m": {"type": "string"}},
                           "required": ["kind", "m"]},
                   "Dog": {"type": OBJ, "properties": {"kind": {"enum": ["dog"]}}, "required": ["kind"]}}
    check_enforceable({"$defs": definitions, "type": OBJ, "properties": {
        "pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "kind"}},
        "owner": {"$ref": "#/$defs/Cat", "description": "who feeds it"},
        "age": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "Age"},
        "id": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        "next": {"$ref": "#"}}})
    definitions["Dog"]["properties"]["kind"] = {"const": "cat"}
    with pytest.raises(ValueError, match="'oneOf' \\(its branches can match together\\) at #/properties/pet"):
        check_enforceable({"$defs": definitions, "type": OBJ, "properties": {
            "pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}}})


def test_a_reference_outside_the_schema_and_an_unlisted_required_key_are_refused() -> None:
    with pytest.raises(ValueError, match="refers to 'https://example.com/s.json' at #/properties/a"):
        check_enforceable({"type": OBJ, "properties": {"a": {"$ref": "https://example.com/s.json"}}})
    with pytest.raises(ValueError, match="refers to '#pp' at #/items: only references within the schema by JSON"):
        check_enforceable({"$defs": {"P": {"$anchor": "pp", "type": "integer"}}, "type": "array",
                           "items": {"$ref": "#pp"}})  # an anchor: taken as any value
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
    assert admits({"type": "string", "enum": ["a", 1]}, "1")
    assert admits({"$defs": {"P": {"type": "integer"}}, "$ref": "#/$defs/P", "minimum": 1000}, "5")
    assert admits({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1")
    assert admits({"type": "string", "format": "date", "pattern": "^2"}, '"1999-01-01"')
    assert admits({"type": "string", "pattern": "^(?!a)[a-c]{1,3}$"}, '"abc"')
    assert admits({"$defs": {"P": {"$anchor": "pp", "type": "integer"}}, "type": "array", "items": {"$ref": "#pp"}},
                  '["x"]')
    assert admits({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "dependencies": {"a": ["b"]}}, '{"a": 1}')
    # xgrammar's own length-bounded string takes a raw control character and no escape (mlc-ai/xgrammar#800):
    # ``with_json_string_characters`` rewrites it (tests/sample/test_grammar.py)
    assert admits({"type": "string", "maxLength": 3}, '"a\x0e"') and not admits({"type": "string", "maxLength": 3},
                                                                                 '"a\\"b"')


def test_pydantics_discriminated_unions_are_let_through() -> None:
    """A defaulted discriminator (not required), one of several values, unions of unions and a callable
    discriminator with tags: their branches' literals are disjoint, so oneOf compiled as anyOf holds."""
    from typing import Annotated, Literal, Union

    from pydantic import BaseModel, Discriminator, Field, Tag

    class Cat(BaseModel):
        kind: Literal["cat", "kitten"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"] = "dog"
        bark: str

    class Fish(BaseModel):
        kind: Literal["fish"]

    class Pets(BaseModel):
        one: Annotated[Union[Cat, Dog], Field(discriminator="kind")]
        nested: Annotated[Union[Annotated[Union[Cat, Dog], Field(discriminator="kind")], Fish],
                          Field(discriminator="kind")]
        many: list[Annotated[Union[Cat, Dog, Fish], Field(discriminator="kind")]] = Field(min_length=1)
        tagged: Annotated[Union[Annotated[Cat, Tag("cat")], Annotated[Dog, Tag("dog")]],
                          Discriminator(lambda value: value.get("kind") if isinstance(value, dict) else None)]

    check_enforceable(Pets.model_json_schema())

    class Kitten(BaseModel):
        kind: Literal["kitten"]

    with pytest.raises(ValueError, match="'oneOf' \\(its branches can match together\\)"):
        check_enforceable({"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Kitten"}],
                           "$defs": {"Cat": Cat.model_json_schema(), "Kitten": Kitten.model_json_schema()}})


def test_a_one_of_whose_branches_list_their_types_is_disjoint_when_no_type_is_in_two() -> None:
    """A nullable string or an integer (a valid schema) was a TypeError: a 500 from the server."""
    check_enforceable({"oneOf": [{"type": ["string", "null"]}, {"type": "integer"}]})
    with pytest.raises(ValueError, match=r"'oneOf' \(its branches can match together\) at #"):
        check_enforceable({"oneOf": [{"type": ["string", "integer"]}, {"type": "number"}]})


@pytest.mark.parametrize(("schema", "words"), [
    ({"$defs": {"a": {"oneOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}}, "$ref": "#/$defs/a"},
     r"'oneOf' \(its branches can match together\) at #/\$defs/a"),  # was a RecursionError
    ({"oneOf": [{"properties": [{}]}, {"type": "string"}]}, "'oneOf'"),
    ({"oneOf": [{"properties": "ab"}, {"properties": "ab"}]}, "'oneOf'"),
    ({"enum": ["a"], "type": {}}, "'type' beside 'enum'"),
    ({"required": [{}]}, r"'required' at # must list property names \(strings\)"),
    ({"required": ["a"], "properties": 5}, "requires 'a' at # without listing it under properties"),
])
def test_a_malformed_schema_is_a_value_error_naming_it_not_a_crash(schema: dict, words: str) -> None:
    """Each was a TypeError or RecursionError inside the check, which the server answered with a 500."""
    with pytest.raises(ValueError, match=words):
        check_enforceable(schema)


def test_a_one_of_whose_definitions_name_one_another_twice_over_is_refused_at_once(monkeypatch) -> None:
    """Each definition a union of the next one twice: 2^22 leaves, a minute of the event loop for a 1.6 KB body.
    The walk stops past 256 of them: it resolves a few thousand references, not millions."""
    from kvserve.sample import json_schema

    resolved, count = json_schema._resolved, [0]

    def counting(schema, root):
        count[0] += 1
        return resolved(schema, root)

    monkeypatch.setattr(json_schema, "_resolved", counting)
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(22)}
    schema = {"$defs": {**defs, "d22": {"type": "integer"}}, "oneOf": [{"$ref": "#/$defs/d0"}, {"type": "string"}]}
    with pytest.raises(ValueError, match=r"'oneOf' \(more than 256 alternatives\) at #"):
        check_enforceable(schema)
    assert count[0] < 10_000
