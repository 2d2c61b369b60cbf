"""Chat messages as chat templates take them, whether they came over HTTP or to ``LLM.chat``: OpenAI's shape
normalised (``template_message``), and tools rendered where the template cannot (``for_template``).

Templates that take ``tools`` get them as transformers passes them. A template that knows no tools (the default
SmolLM2's among them) still gets a working tool conversation: the tools are described in the system message in
the Hermes format (which the server's parser then reads), earlier calls are written into the assistant's text as
``<tool_call>`` blocks and tool results go back as ``<tool_response>`` blocks.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping, Sequence

import jinja2


def template_message(message: Mapping[str, Any], index: int = 0, keep_parts: bool = False,
                     developer_is_system: bool = False) -> dict[str, Any]:
    """``message`` (OpenAI's shape) as a chat template expects it: text parts as a list of ``{"type": "text",
    "text": ...}`` for a template that iterates over them (``keep_parts``, see ``iterates_content``), else joined
    with newlines, as vLLM does; no content as ""; a call's arguments as a dict, as transformers' templates take
    them; OpenAI's ``developer`` role as ``system`` for a template that knows no such role
    (``developer_is_system``): OpenAI's newer name for the system prompt; an assistant's ``reasoning`` also as
    ``reasoning_content``, as vLLM passes it. ValueError naming ``messages[index]``
    where it cannot be rendered."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{index}] must be a dict with a 'role' and a 'content'")
    out = dict(message)
    if developer_is_system and out["role"] == "developer":
        out["role"] = "system"
    out["content"] = _content(message.get("content"), index, keep_parts)
    if isinstance(message.get("reasoning"), str):  # vLLM's name; the templates that render it (Qwen3's) read this one
        out.setdefault("reasoning_content", message["reasoning"])
    if message.get("tool_calls") is not None:
        if not isinstance(message["tool_calls"], (list, tuple)):
            raise ValueError(f"messages[{index}].tool_calls must be a list of calls")
        out["tool_calls"] = [_call(call, index) for call in message["tool_calls"]]
    return out


def _content(content: Any, index: int, keep_parts: bool) -> str | list[dict[str, str]]:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        parts = [{"type": "text", "text": str(part.get("text", ""))} for part in content]
        return parts if keep_parts else joined(parts)
    raise ValueError(f"messages[{index}].content must be text or a list of text parts")


def joined(content: str | list[dict[str, str]]) -> str:
    """A message's content as one text: its text parts joined with newlines."""
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


@functools.lru_cache(maxsize=8)  # a server renders with one or two templates
def iterates_content(chat_template: str) -> bool:
    """Whether the template loops over a message's content (``{% for item in message['content'] %}``, as Gemma 3's
    does): it then takes the text parts as a list, as transformers and vLLM pass them (vLLM's "openai" content
    format), and renders them its own way (Gemma 3's trims and concatenates them)."""
    try:
        tree = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return False  # transformers will say what is wrong with it
    for loop in tree.find_all(jinja2.nodes.For):
        over = loop.iter
        if isinstance(over, jinja2.nodes.Getitem) and isinstance(over.arg, jinja2.nodes.Const):
            if over.arg.value == "content":
                return True
        elif isinstance(over, jinja2.nodes.Getattr) and over.attr == "content":
            return True
    return False


def _call(call: Mapping[str, Any], index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or "name" not in function:
        raise ValueError(f"messages[{index}].tool_calls: each call needs a function with a name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):  # nested past Python's recursion limit: no arguments either
            raise ValueError(f"messages[{index}]: tool call arguments are not JSON: {arguments[:80]!r}") from None
    if not isinstance(arguments, Mapping):  # a function's arguments are an object of named values
        raise ValueError(f"messages[{index}]: tool call arguments must be a JSON object, got "
                         f"{type(arguments).__name__}")
    return {**call, "type": "function", "function": {**function, "arguments": arguments}}


def takes_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def for_template(conversation: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                 chat_template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the tools to render: unchanged for a template that takes tools; for one that
    does not, calls and results as Hermes blocks in the text (a result speaks as the user, which every
    template takes) and the tools described in the system message."""
    if takes_tools(chat_template):
        return conversation, list(tools) if tools else None
    conversation = [_with_calls_in_text(m) for m in conversation]
    return (_describe_tools(conversation, tools) if tools else conversation), None


def _describe_tools(conversation: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    preamble = (
        "You can call functions to answer. Their signatures, one JSON object a line:\n<tools>\n"
        f"{lines}\n</tools>\n"
        "To call one, reply with a JSON object naming it and giving its arguments, inside a <tool_call> block:\n"
        '<tool_call>\n{"name": "function name", "arguments": {"argument": "value"}}\n</tool_call>'
    )
    out = list(conversation)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{joined(out[0]['content'])}\n\n{preamble}"}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out


def _with_calls_in_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{joined(message['content'])}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [
        "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                     ensure_ascii=False) + "\n</tool_call>"
        for c in calls
    ]
    text = "\n".join(([joined(message["content"])] if message["content"] else []) + blocks)
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": text}
