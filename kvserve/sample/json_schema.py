"""Which JSON schemas a grammar can hold the output to: ``enforceable_schema`` refuses a schema that uses a keyword
xgrammar compiles without enforcing (the output could then break the schema while the reply says it finished),
and rewrites what it can say exactly in enforced terms.

Measured on xgrammar 0.2.9: ``allOf``, ``not``, ``if`` / ``then`` / ``else``, ``uniqueItems``, ``contains``,
``dependentRequired`` / ``dependentSchemas``, ``multipleOf`` and the exclusive bounds compile but are not
enforced (``[1, 1]`` passes ``uniqueItems``, 5 passes ``exclusiveMinimum: 5``); a ``$ref`` outside the schema is
taken as any value; a ``required`` key that ``properties`` does not list can never be written (objects admit only
listed keys unless ``additionalProperties`` says otherwise). vLLM's xgrammar backend refuses such schemas too.
An integer's exclusive bound is an inclusive one a step inside, so those are rewritten rather than refused.
"""

from __future__ import annotations

from typing import Any

UNENFORCED_KEYWORDS = frozenset({
    "allOf", "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "multipleOf", "exclusiveMinimum", "exclusiveMaximum",
    "unevaluatedProperties", "unevaluatedItems",
})
# keywords whose values are names or literals, not schemas: never walked into
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required", "title", "description"})
# keywords whose values map names (of properties, of definitions) to schemas
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def enforceable_schema(schema: Any, path: str = "#") -> Any:
    """``schema`` as the grammar should compile it; ValueError naming the keyword and where it is (a JSON
    pointer such as ``#/properties/tags``) if the grammar could not hold the output to it."""
    if isinstance(schema, list):
        return [enforceable_schema(item, f"{path}/{i}") for i, item in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    schema = _inclusive_integer_bounds(schema)
    unenforced = sorted(UNENFORCED_KEYWORDS & schema.keys())
    if unenforced:
        raise ValueError(f"the JSON schema uses {unenforced[0]!r} at {path}, which structured output cannot "
                         "enforce")
    _check_required(schema, path)
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"the JSON schema refers to {ref!r} at {path}: only references within the schema "
                         "('#/...') are followed")
    return {key: _walk(key, value, f"{path}/{key}") for key, value in schema.items()}


def _walk(key: str, value: Any, path: str) -> Any:
    if key in _DATA_KEYWORDS:
        return value
    if key in _NAMED_SCHEMAS and isinstance(value, dict):
        return {name: enforceable_schema(sub, f"{path}/{name}") for name, sub in value.items()}
    return enforceable_schema(value, path)


def _inclusive_integer_bounds(schema: dict[str, Any]) -> dict[str, Any]:
    """An integer's ``exclusiveMinimum: n`` as ``minimum: n + 1`` (and the maximum likewise), the tighter of it
    and a ``minimum`` already there."""
    if schema.get("type") != "integer":
        return schema
    schema = dict(schema)
    for exclusive, inclusive, step, tighter in (("exclusiveMinimum", "minimum", 1, max),
                                                ("exclusiveMaximum", "maximum", -1, min)):
        bound = schema.get(exclusive)
        if isinstance(bound, (int, float)) and not isinstance(bound, bool) and float(bound).is_integer():
            del schema[exclusive]
            edge = int(bound) + step
            schema[inclusive] = tighter(edge, schema[inclusive]) if inclusive in schema else edge
    return schema


def _check_required(schema: dict[str, Any], path: str) -> None:
    required, properties = schema.get("required"), schema.get("properties")
    missing = [key for key in required if key not in (properties or {})] if isinstance(required, list) else []
    if missing:
        raise ValueError(f"the JSON schema requires {', '.join(map(repr, missing))} at {path} without listing "
                         "it under properties: structured output writes only the properties listed")
