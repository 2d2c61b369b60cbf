"""Which JSON schemas a grammar can hold the output to: ``check_enforceable`` refuses a schema that uses a keyword
xgrammar compiles without enforcing (the output could then break the schema while the reply says it finished).

Measured on xgrammar 0.2.9, a document counting as admitted where the matcher takes it and then the stop token:
``allOf``, ``not``, ``if`` / ``then`` / ``else``, ``uniqueItems``, ``contains`` (beside ``items``),
``dependentRequired`` and ``dependentSchemas`` compile but are not enforced (``[1, 1]`` passes ``uniqueItems``,
``0`` passes ``not: {const: 0}``), nor is a fractional ``multipleOf`` (0.3 passes ``multipleOf: 0.5``; an
integer's is enforced, as are the exclusive bounds); ``minLength`` / ``maxLength`` beside ``pattern`` or
``format``, and any constraint beside ``enum`` or ``const``, are dropped (``"abcdef"`` passes ``pattern: ^[a-z]+$``
with ``maxLength: 3``); a ``$ref`` outside the schema is taken as any value; a
``required`` key that ``properties`` does not list can never be written (objects admit only listed keys unless
``additionalProperties`` says otherwise). vLLM's xgrammar backend refuses such schemas too.
"""

from __future__ import annotations

from typing import Any

UNENFORCED_KEYWORDS = frozenset({
    "allOf", "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas",
})
# what a value must satisfy besides its type: the grammar writes any of an enum's or a const's values regardless
_CONSTRAINTS = frozenset({
    "pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minItems", "maxItems", "items", "prefixItems", "minProperties", "maxProperties", "properties",
    "additionalProperties", "patternProperties", "propertyNames",
})
# keywords whose values are names or literals, not schemas: never walked into
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required", "title", "description"})
# keywords whose values map names (of properties, of definitions) to schemas
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def check_enforceable(schema: Any, path: str = "#") -> None:
    """ValueError naming the keyword and where it stands (a JSON pointer such as ``#/properties/tags``) if the
    grammar could not hold the output to ``schema``."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_enforceable(item, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    unenforced = ([repr(key) for key in sorted(UNENFORCED_KEYWORDS & schema.keys())] or _fractional_multiple(schema)
                  or _beside(schema))
    if unenforced:
        raise ValueError(f"the JSON schema uses {unenforced[0]} at {path}, which structured output cannot "
                         "enforce")
    _check_required(schema, path)
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"the JSON schema refers to {ref!r} at {path}: only references within the schema "
                         "('#/...') are followed")
    for key, value in schema.items():
        if key in _NAMED_SCHEMAS and isinstance(value, dict):  # names of properties or definitions: not keywords
            for name, sub in value.items():
                check_enforceable(sub, f"{path}/{key}/{name}")
        elif key not in _DATA_KEYWORDS:
            check_enforceable(value, f"{path}/{key}")


def _fractional_multiple(schema: dict[str, Any]) -> list[str]:
    """["'multipleOf'"] where it is not an integer's multiple of an integer (those the grammar does enforce)."""
    step = schema.get("multipleOf")
    if step is None or schema.get("type") == "integer" and isinstance(step, int) and not isinstance(step, bool):
        return []
    return ["'multipleOf'"]


def _beside(schema: dict[str, Any]) -> list[str]:
    """A keyword the grammar drops for another beside it: a string's lengths beside its ``pattern`` or
    ``format``, and every constraint beside ``enum`` or ``const`` (whose values alone it writes)."""
    for literal in ("enum", "const"):
        if literal in schema:
            return [f"{key!r} beside {literal!r}" for key in sorted(_CONSTRAINTS & schema.keys())][:1]
    shape = next((key for key in ("pattern", "format") if key in schema), None)
    return [f"{key!r} beside {shape!r}" for key in ("minLength", "maxLength") if shape and key in schema][:1]


def _check_required(schema: dict[str, Any], path: str) -> None:
    required, properties = schema.get("required"), schema.get("properties")
    missing = [key for key in required if key not in (properties or {})] if isinstance(required, list) else []
    if missing:
        raise ValueError(f"the JSON schema requires {', '.join(map(repr, missing))} at {path} without listing "
                         "it under properties: structured output writes only the properties listed")
