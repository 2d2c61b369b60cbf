"""Which JSON schemas a grammar can hold the output to: ``check_enforceable`` refuses a schema that uses a keyword
xgrammar compiles without enforcing (the output could then break the schema while the reply says it finished).

Measured on xgrammar 0.2.9, a document counting as admitted where the matcher takes it and then the stop token:
``allOf``, ``not``, ``if`` / ``then`` / ``else``, ``uniqueItems``, ``contains`` (beside ``items``),
``dependentRequired`` and ``dependentSchemas`` compile but are not enforced (``[1, 1]`` passes ``uniqueItems``,
``0`` passes ``not: {const: 0}``), nor is a fractional ``multipleOf`` (0.3 passes ``multipleOf: 0.5``; an
integer's is enforced, as are the exclusive bounds); ``minLength`` / ``maxLength`` or ``pattern`` beside
``format``, lengths beside ``pattern``, and any constraint or ``type`` beside ``enum`` or ``const``, are dropped
(``"abcdef"`` passes ``pattern: ^[a-z]+$`` with ``maxLength: 3``), as is every assertion beside ``$ref``,
``anyOf`` or ``oneOf`` (``5`` passes a ``$ref`` with ``minimum: 1000``); ``oneOf`` is compiled as ``anyOf`` (a
document matching two branches passes), which holds only where its branches cannot both match (distinct types,
or pydantic's discriminated unions: a distinct ``const`` of one required property); a lookaround in a ``pattern``
is dropped (a ``regex`` constraint's is refused by xgrammar); a ``$ref`` outside the schema, or to an anchor
(``#name``), is taken as any value, and draft-07's ``dependencies`` is not enforced; a ``required`` key that
``properties`` does not list can never be written (objects admit only listed keys unless
``additionalProperties`` says otherwise). vLLM's xgrammar backend refuses such schemas too.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Iterator

UNENFORCED_KEYWORDS = frozenset({
    "allOf", "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies",
})
# what a value must satisfy besides its type: the grammar writes any of an enum's or a const's values regardless
_CONSTRAINTS = frozenset({
    "pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minItems", "maxItems", "items", "prefixItems", "minProperties", "maxProperties", "properties",
    "additionalProperties", "patternProperties", "propertyNames",
})
# what constrains a value beside a reference or a composition, which the grammar then drops (annotations such as
# title, description, default are no assertions)
_ASSERTIONS = _CONSTRAINTS | {"type", "required", "enum", "const", "$ref", "anyOf", "oneOf"}
_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")  # (?= (?! (?<= (?<!, not escaped
MAX_UNION_LEAVES = 256  # a oneOf's alternatives, its nested unions' flattened: past them it is refused
# keywords whose values are names or literals, not schemas: never walked into
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "required", "title", "description"})
# keywords whose values map names (of properties, of definitions) to schemas
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def check_enforceable(schema: Any, path: str = "#", root: Any = None) -> None:
    """ValueError naming the keyword and where it stands (a JSON pointer such as ``#/properties/tags``) if the
    grammar could not hold the output to ``schema`` (within ``root``, the whole schema, which references point
    into)."""
    root = schema if root is None else root
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_enforceable(item, f"{path}/{i}", root)
        return
    if not isinstance(schema, dict):
        return
    unenforced = ([repr(key) for key in sorted(UNENFORCED_KEYWORDS & schema.keys())] or _fractional_multiple(schema)
                  or _beside(schema) or _lookaround(schema) or _overlapping_one_of(schema, root))
    if unenforced:
        raise ValueError(f"the JSON schema uses {unenforced[0]} at {path}, which structured output cannot "
                         "enforce")
    _check_required(schema, path)
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise ValueError(f"the JSON schema refers to {ref[:100]!r} at {path}: only references within the "
                         "schema by JSON pointer ('#/...') are followed")
    for key, value in schema.items():
        if key in _NAMED_SCHEMAS and isinstance(value, dict):  # names of properties or definitions: not keywords
            for name, sub in value.items():
                check_enforceable(sub, f"{path}/{key}/{name}", root)
        elif key not in _DATA_KEYWORDS:
            check_enforceable(value, f"{path}/{key}", root)


def _fractional_multiple(schema: dict[str, Any]) -> list[str]:
    """["'multipleOf'"] where it is not an integer's multiple of an integer (those the grammar does enforce)."""
    step = schema.get("multipleOf")
    if step is None or schema.get("type") == "integer" and isinstance(step, int) and not isinstance(step, bool):
        return []
    return ["'multipleOf'"]


def _beside(schema: dict[str, Any]) -> list[str]:
    """A keyword the grammar drops for another beside it: every assertion beside ``$ref``, ``anyOf`` or
    ``oneOf``; every constraint, and a ``type`` some value breaks, beside ``enum`` or ``const`` (whose values
    alone it writes); a string's lengths or ``pattern`` beside its ``format``, its lengths beside its
    ``pattern``."""
    for composition in ("$ref", "anyOf", "oneOf"):
        if composition in schema:
            dropped = sorted(_ASSERTIONS & schema.keys() - {composition})
            return [f"{key!r} beside {composition!r}" for key in dropped][:1]
    for literal in ("enum", "const"):
        if literal in schema:
            dropped = sorted(_CONSTRAINTS & schema.keys()) + (["type"] if _breaks_type(schema, literal) else [])
            return [f"{key!r} beside {literal!r}" for key in dropped][:1]
    shape = next((key for key in ("format", "pattern") if key in schema), None)
    return [f"{key!r} beside {shape!r}" for key in ("pattern", "minLength", "maxLength")
            if shape and key != shape and key in schema][:1]


def _breaks_type(schema: dict[str, Any], literal: str) -> bool:
    """Whether a value of ``enum`` or ``const`` is not of the schema's ``type`` (the grammar would write it)."""
    if "type" not in schema:
        return False
    values = schema[literal] if literal == "enum" and isinstance(schema[literal], list) else [schema[literal]]
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return not all(any(_is_of_type(value, kind) for kind in types) for value in values)


def _is_of_type(value: Any, kind: Any) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "null": type(None), "array": list, "object": dict}
    return isinstance(kind, str) and kind in kinds and isinstance(value, kinds[kind])


def _lookaround(schema: dict[str, Any]) -> list[str]:
    """A ``pattern`` with a lookahead or lookbehind, which the grammar drops (and refuses in a ``regex``)."""
    pattern = schema.get("pattern")
    return ["a lookaround in 'pattern'"] if isinstance(pattern, str) and _LOOKAROUND.search(pattern) else []


def _overlapping_one_of(schema: dict[str, Any], root: Any) -> list[str]:
    """["'oneOf' ..."] unless its branches cannot both match: each of its own single ``type``, or each with its own
    literals (``const`` or ``enum``) of one property, as pydantic's discriminated unions (whose branches are
    references into ``root``, and may be unions themselves). Where a branch leaves that property out of
    ``required`` (a defaulted discriminator), a document without it could still match two (README)."""
    branches = schema.get("oneOf")
    if not isinstance(branches, list) or len(branches) < 2:
        return []
    leaves = list(itertools.islice((leaf for branch in branches for leaf in _union_leaves(branch, root, frozenset())),
                                   MAX_UNION_LEAVES + 1))  # lazily: references shared by branches multiply them
    if len(leaves) > MAX_UNION_LEAVES:
        return [f"'oneOf' (more than {MAX_UNION_LEAVES} alternatives)"]
    if not all(isinstance(leaf, dict) for leaf in leaves):
        return ["'oneOf'"]
    kinds = [_type_names(leaf.get("type")) for leaf in leaves]
    if all(kinds) and sum(map(len, kinds)) == len(set().union(*kinds)):  # no type in two branches
        return []
    return [] if _discriminated(leaves) else ["'oneOf' (its branches can match together)"]


def _type_names(kind: Any) -> set[str]:
    """The types a ``type`` keyword names (a name, or a list of them; ``integer`` counted as ``number``, which
    every integer also is); none where it is absent or malformed."""
    names = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    if not names or not all(isinstance(name, str) for name in names):
        return set()
    return {"number" if name == "integer" else name for name in names}


def _union_leaves(schema: Any, root: Any, followed: frozenset[str]) -> Iterator[Any]:
    """``schema`` resolved, or the leaves of the union it is (a ``oneOf`` or ``anyOf`` and nothing else), one at a
    time (definitions that name one another twice over make 2^depth of them: a 1.6 KB schema took a minute);
    ``followed``: the references resolved on the way, so that a union that refers back to itself ends there (a
    leaf with no type: the union is then taken to overlap)."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if isinstance(ref, str) and ref in followed:
        yield schema
        return
    resolved = _resolved(schema, root)
    if isinstance(resolved, dict):
        inner = resolved.get("oneOf", resolved.get("anyOf"))
        if isinstance(inner, list) and not _ASSERTIONS & resolved.keys() - {"oneOf", "anyOf"}:
            followed = followed | {ref} if isinstance(ref, str) else followed
            for branch in inner:
                yield from _union_leaves(branch, root, followed)
            return
    yield resolved


def _discriminated(branches: list[dict[str, Any]]) -> bool:
    """Whether one property, in every branch, has literals that no other branch's literals share."""
    properties = [branch.get("properties") if isinstance(branch.get("properties"), dict) else {}
                  for branch in branches]
    named = set.intersection(*(set(listed) for listed in properties))
    for name in sorted(named):
        literals = [_literals(listed[name]) for listed in properties]
        if all(literals) and sum(map(len, literals)) == len(set().union(*literals)):
            return True
    return False


def _literals(schema: Any) -> set[str]:
    """The values ``schema`` allows, as JSON texts, where it lists them (``const``, ``enum``); else none."""
    if isinstance(schema, dict) and "const" in schema:
        return {json.dumps(schema["const"], sort_keys=True)}
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        return {json.dumps(value, sort_keys=True) for value in schema["enum"]}
    return set()


def _resolved(schema: Any, root: Any) -> Any:
    """``schema``, or what its ``$ref`` points to in ``root`` (a JSON pointer, "~1" and "~0" unescaped); None
    where it points nowhere (xgrammar then refuses the schema itself)."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#"):
        return schema
    target = root
    for part in ref[2:].split("/") if ref.startswith("#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        target = target.get(part) if isinstance(target, dict) else None
    return target


def _check_required(schema: dict[str, Any], path: str) -> None:
    required, properties = schema.get("required"), schema.get("properties")
    if not isinstance(required, list):
        return
    if not all(isinstance(key, str) for key in required):
        raise ValueError(f"the JSON schema's 'required' at {path} must list property names (strings)")
    missing = [key for key in required if key not in (properties if isinstance(properties, dict) else {})]
    if missing:
        raise ValueError(f"the JSON schema requires {', '.join(map(repr, missing))} at {path} without listing "
                         "it under properties: structured output writes only the properties listed")


# xgrammar 0.2.9 writes the characters of a string with ``minLength`` / ``maxLength`` as ``[^"\\\r\n]``: raw
# control characters admitted (the output is no JSON: pydantic's ``max_length`` met it) and no escape
# (mlc-ai/xgrammar#800). ``with_json_string_characters`` rewrites such a rule as JSON's own string character: one
# that is no control character, quote or backslash, or an escape (one character, as the bound counts it).
_BOUNDED_STRING_CHARACTER = re.compile(r'^(\S+ ::= )\(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_STRING_CHARACTER = r'(([^\0-\x1f\"\\]) | ("\\" kvserve_json_escape))'
_JSON_ESCAPE_RULE = r'kvserve_json_escape ::= (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'


def with_json_string_characters(ebnf: str) -> str:
    """The grammar xgrammar converted a schema to (its EBNF text), with every length-bounded string's character
    rule written as JSON's; the text itself where it has none."""
    fixed = _BOUNDED_STRING_CHARACTER.sub(lambda rule: rule.group(1) + _JSON_STRING_CHARACTER, ebnf)
    return ebnf if fixed == ebnf else f"{fixed}\n{_JSON_ESCAPE_RULE}\n"

