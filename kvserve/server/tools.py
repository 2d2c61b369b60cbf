"""Tools in chat requests: what ``tool_choice`` does to a request, and how tool conversations reach a chat
template.

- ``required`` and a named function are enforced by a grammar: the output is constrained to a JSON array of
  ``{"name", "parameters"}`` calls of the given functions (one at most without ``parallel_tool_calls``), or to
  the named function's parameters object; ``auto`` lets the model write its own call format, which a
  ``tool_parsers`` parser (``pythonic_tool_parser``'s for the pythonic list) reads out of the text
  (``--tool-call-parser``, or the format the chat template shows). ``none`` shows the tools to the template and
  reads nothing.
- How a conversation with tools reaches a chat template (described in the Hermes format where the template
  takes none) is ``engine/chat_messages.py``'s, which the offline ``LLM.chat`` shares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from kvserve.engine.chat_messages import takes_tools
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.pythonic_tool_parser import PythonicToolCallParser
from kvserve.server.tool_parsers import (
    FORMATS,
    REQUIRED_FORMAT,
    NamedToolCallParser,
    OutputParser,
    ToolCallFormat,
    ToolCallParser,
)

if TYPE_CHECKING:
    import jsonschema

TOOL_CALL_PARSERS = ("auto", *FORMATS)
# OpenAI: a function whose parameters are left out takes none
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_constraint(tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any],
                    parallel_tool_calls: bool) -> StructuredOutputsParams | None:
    """The grammar ``tool_choice`` puts on the output (None for ``auto`` and ``none``). ``tools`` are OpenAI's
    ``{"type": "function", "function": {...}}`` dicts."""
    if isinstance(tool_choice, dict):
        function = _function(tools, tool_choice["function"]["name"])
        return StructuredOutputsParams(json=function.get("parameters") or _NO_PARAMETERS)
    if tool_choice != "required":
        return None
    calls, definitions = [], {}
    for i, tool in enumerate(tools):
        parameters, own_definitions = _nested(tool["function"].get("parameters") or _NO_PARAMETERS, i)
        definitions.update(own_definitions)
        calls.append({"type": "object",
                      "properties": {"name": {"const": tool["function"]["name"]}, "parameters": parameters},
                      "required": ["name", "parameters"]})
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if definitions:
        array["$defs"] = definitions
    if not parallel_tool_calls:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


_DEFINITIONS = ("$defs", "definitions")
_LITERALS = frozenset({"const", "enum", "default", "examples"})  # data, whose "$ref" keys are no references
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _nested(parameters: dict[str, Any], index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Function ``index``'s parameters as they sit inside the array of calls, and their definitions, which move
    to the array's root under names of their own: a local ``$ref`` (``#/$defs/Loc``, as pydantic and the openai
    SDK's ``pydantic_function_tool`` write them) resolves from the root of the whole schema, so each is
    rewritten to where its target now is."""
    inside = f"#/items/anyOf/{index}/properties/parameters"
    hoisted = [key for key in _DEFINITIONS if isinstance(parameters.get(key), dict)]  # else left to fail to compile

    def moved(ref: str) -> str:
        parts = ref[1:].split("/")  # a JSON pointer: "", "$defs", "Loc", ...
        if len(parts) >= 3 and parts[1] in hoisted:
            return f"#/$defs/{index}.{parts[1]}.{parts[2]}" + "".join("/" + part for part in parts[3:])
        return inside + ref[1:]

    def rewrite(node: Any, names: bool = False) -> Any:
        """``node`` with its references moved; ``names``: a mapping of names to schemas (``properties``)."""
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        if names:
            return {name: rewrite(schema) for name, schema in node.items()}
        return {key: moved(value) if key == "$ref" and isinstance(value, str) and value.startswith("#")
                else value if key in _LITERALS else rewrite(value, names=key in _NAMED_SCHEMAS)
                for key, value in node.items()}

    definitions = {f"{index}.{key}.{name}": rewrite(schema) for key in hoisted
                   for name, schema in parameters[key].items()}
    return rewrite({key: value for key, value in parameters.items() if key not in hoisted}), definitions


def tool_call_format(parser: str, chat_template: str | None) -> ToolCallFormat:
    """The format the model writes calls in: Hermes for a template that takes no tools (kvserve describes them
    in that format), else the one ``--tool-call-parser`` names; ``auto`` reads it off the template's own text
    (``ToolCallFormat.written_by``: its markers; for ``pythonic``, Meta's ``[func_name1(...`` instruction or an
    earlier call written back as ``name(``), and falls back to Hermes, the most common."""
    if not takes_tools(chat_template):
        return FORMATS["hermes"]
    if parser != "auto":
        return FORMATS[parser]
    assert chat_template is not None
    return next((fmt for fmt in FORMATS.values() if fmt.written_by(chat_template)), FORMATS["hermes"])


class DeclaredTools:
    """The functions a request declares, which the ``auto`` parser checks each call against (under
    ``required`` and a named function the grammar writes only such calls): a call of another function is no
    call, since OpenAI only ever calls declared ones; nor is a call of a ``strict`` function whose arguments
    break its parameters' schema, since ``strict`` promises they follow it. Its schema errors are ValueErrors."""

    def __init__(self, tools: Sequence[dict[str, Any]]) -> None:
        self.names = frozenset(t["function"]["name"] for t in tools)
        self._strict: dict[str, jsonschema.protocols.Validator] = {}
        for tool in tools:
            function = tool["function"]
            if function.get("strict"):
                self._strict[function["name"]] = _validator(function.get("parameters") or _NO_PARAMETERS)

    def knows(self, name: str) -> bool:
        return name in self.names

    def accepts(self, name: str, arguments: dict[str, Any]) -> bool:
        validator = self._strict.get(name)
        return validator is None or validator.is_valid(arguments)


def _validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    return checked_schema(schema)(schema)


def checked_schema(schema: dict[str, Any]) -> type[jsonschema.protocols.Validator]:
    """The validator class of a function's parameters' schema, or ValueError saying why it is no valid JSON
    schema (under its own ``$schema``'s meta-schema)."""
    import jsonschema  # only where tools come

    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ValueError(f"no valid JSON schema: {error.message}") from None
    return cls


def output_parser(tool_choice: str | dict[str, Any], parallel_tool_calls: bool, fmt: ToolCallFormat,
                  declared: DeclaredTools | None = None) -> OutputParser | None:
    """A fresh parser for one sample's output, or None when the output is plain content. ``declared``: the
    request's tools, which ``auto``'s calls are checked against."""
    if isinstance(tool_choice, dict):
        return NamedToolCallParser(tool_choice["function"]["name"])
    max_calls = None if parallel_tool_calls else 1
    if tool_choice == "required":
        return ToolCallParser(REQUIRED_FORMAT, max_calls)
    if tool_choice != "auto":
        return None
    if fmt is FORMATS["pythonic"]:
        return PythonicToolCallParser(max_calls, declared)
    return ToolCallParser(fmt, max_calls, declared)


def needs_special_tokens(fmt: ToolCallFormat, tokenizer: Any) -> bool:
    """Whether decoding with special tokens skipped drops one of the format's markers (Mistral's
    ``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``, Llama 4's ``<|python_start|>``: special added tokens). Tried
    on the marker itself: transformers 5 lists only the named special tokens (BOS, EOS...) in
    ``all_special_tokens``, not every added token flagged special, which the decoder drops all the same."""
    return any(dropped_by_decoding(tokenizer, marker) for marker in fmt.markers)


def dropped_by_decoding(tokenizer: Any, marker: str) -> bool:
    """Whether decoding with special tokens skipped drops ``marker`` (a special added token's text)."""
    token_ids = tokenizer.encode(marker, add_special_tokens=False)
    return tokenizer.decode(token_ids, skip_special_tokens=True) != tokenizer.decode(token_ids)


def _function(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The function ``name`` of ``tools`` (the request's validation refused a tool_choice naming another)."""
    return next(tool["function"] for tool in tools if tool["function"]["name"] == name)
