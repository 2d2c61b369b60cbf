"""The text a request's KV prefix comes from, read from its OpenAI-shaped body: what the router (and the Ray
ingress) key prefixes on (``prefix_index.prefix_keys``).

A body is read leniently: one that is no JSON object, or fields of the wrong type, count as no text, and the
request is forwarded all the same, so that the replica refuses it in its own words. Only the first
``MAX_KEYED_CHARS`` characters are read (all that is keyed), so a huge prompt costs the router no more.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

from kvserve.router.prefix_index import MAX_KEYED_CHARS


def request_payload(body: bytes) -> dict[str, Any]:
    """The JSON object a request carries, or {} (no prompt) if its body is none: it is forwarded all the same,
    so that the replica's 400 is the one the client gets."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past Python's recursion limit
        return {}
    return payload if isinstance(payload, dict) else {}


# the pooling endpoints (``server/pooling.py``): a prompt or messages to embed, or texts to score
EMBEDDING_PATHS = frozenset({"/v1/embeddings", "/pooling"})
SCORE_PATHS = frozenset({"/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})
# a score request's first text, in the field of each of vLLM's spellings (rerank's query first)
_FIRST_TEXT_FIELDS = ("query", "queries", "data_1", "text_1")


def request_text(path: str, payload: dict[str, Any]) -> str:
    """The text a request to ``path`` is keyed on: ``prompt_text``'s, or a pooling request's: an embedding's
    ``input`` (as a completion's prompt) or messages, a score's or rerank's first text (its query: the other
    texts are prompts of their own, which share no prefix with it)."""
    if path in EMBEDDING_PATHS and not isinstance(payload.get("messages"), list):
        return _namespaced(payload, _prompt(payload.get("input", "")))
    if path in SCORE_PATHS:
        first = next((payload[name] for name in _FIRST_TEXT_FIELDS if name in payload), "")
        return _namespaced(payload, _text(first[0] if isinstance(first, list) and first else first))
    return prompt_text(payload)


def prompt_text(payload: dict[str, Any]) -> str:
    """The text a request's KV prefix comes from, its first ``MAX_KEYED_CHARS`` characters (all that is keyed):
    the completion prompt, the chat messages in order (after an Anthropic Messages request's ``system``), or a
    Responses request's instructions and input items, after its ``model`` and ``cache_salt`` (a replica shares
    blocks only between requests of one salt, and of one LoRA adapter, which ``model`` names). Fields of the wrong
    type count as no text: the replica refuses them with its own 400."""
    return _namespaced(payload, _unsalted_text(payload))


def _namespaced(payload: dict[str, Any], text: str) -> str:
    model, salt = _text(payload.get("model")), _text(payload.get("cache_salt"))
    namespace = (f"model:{model}\n" if model else "") + (f"cache_salt:{salt}\n" if salt else "")
    return (namespace + text)[:MAX_KEYED_CHARS]


def _unsalted_text(payload: dict[str, Any]) -> str:
    messages = payload.get("messages")
    if isinstance(messages, list):
        return _leading_lines(_messages_lines(payload.get("system"), messages))
    if "input" in payload:
        return _leading_lines(_responses_lines(payload))
    return _prompt(payload.get("prompt", ""))


def _prompt(prompt: Any) -> str:
    """A completion's prompt (or an embedding's input): its text, or the JSON of its token ids or prompts."""
    if isinstance(prompt, list):  # token ids or several prompts; each item is at least a character of the JSON
        try:
            prompt = json.dumps(prompt[:MAX_KEYED_CHARS])
        except RecursionError:  # nested too deep to print again (the replica refuses it): keyed as no prefix
            return ""
    return _text(prompt)[:MAX_KEYED_CHARS]


def _messages_lines(system: Any, messages: list[Any]) -> Iterator[str]:
    """Chat messages as lines, each its role and text; an Anthropic request's ``system`` (its system message) first."""
    if _content_text(system):
        yield f"system:{_content_text(system)}"
    for message in messages:
        if isinstance(message, dict):
            yield f"{_text(message.get('role'))}:{_content_text(message.get('content'))}"


def _responses_lines(payload: dict[str, Any]) -> Iterator[str]:
    """A Responses request as lines, as its chat request renders it: the instructions (its system message), then
    each input item (a message's role and text; a call's arguments, a call's output)."""
    instructions = _text(payload.get("instructions"))
    if instructions:
        yield f"system:{instructions}"
    items = payload.get("input")
    if isinstance(items, str):
        yield f"user:{items}"
        return
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict):
            kind = _text(item.get("role")) or _text(item.get("type"))
            text = _content_text(item.get("content")) or _text(item.get("arguments")) or _text(item.get("output"))
            yield f"{kind}:{text}"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _content_text(content: Any, nested: bool = True) -> str:
    """Content parts' text, or Anthropic's blocks': a call's name, a call's result (whose own blocks are read one
    level down, no further: a body nested thousands deep is the replica's to refuse, not a recursion here)."""
    if isinstance(content, list):
        return "".join(_text(part.get("text")) or _text(part.get("name"))
                       or (_content_text(part.get("content"), nested=False) if nested else "")
                       for part in content if isinstance(part, dict))
    return _text(content)


def _leading_lines(lines: Iterable[str]) -> str:
    """``lines`` joined by newlines, cut to the first ``MAX_KEYED_CHARS`` characters, without joining the lines
    after those."""
    taken, size = [], 0
    for line in lines:
        taken.append(line)
        size += len(line) + 1
        if size > MAX_KEYED_CHARS:
            break
    return "\n".join(taken)[:MAX_KEYED_CHARS]
