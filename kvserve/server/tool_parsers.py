"""Tool calls read out of a model's text as it streams: Hermes / Qwen ``<tool_call>{...}</tool_call>``, Llama 3's
bare JSON (``{"name": ..., "parameters": {...}}``, after ``<|python_tag|>`` or at the start of the output),
Mistral's ``[TOOL_CALLS][{...}, ...]``, and the JSON array that ``tool_choice: required`` constrains the
output to. The ``pythonic`` format (``[get_weather(city="Oslo")]``) is ``pythonic_tool_parser``'s.

One parser serves both the streamed and the whole answer: ``feed`` takes each new piece of text and returns
what can be said of it now (content, a call's id and name, pieces of its arguments), ``finish`` flushes what
was held back. The whole answer is the same deltas folded, so streaming and non-streaming always give the
same calls. The parser walks each call's JSON object one character at a time (strings and escapes included),
so a call ends where its object closes: braces or a literal ``</tool_call>`` inside an argument string end
nothing. A call's ``arguments`` are the raw JSON text of its arguments object as the model wrote it, streamed
as it grows; text that only might start a marker (``<tool_`` at the end of a delta) waits for the next delta.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes and Mistral write "arguments", Llama 3 "parameters"
_SEPARATORS = " \t\r\n[],;"  # what may stand between the calls of one run: arrays, commas, Llama's "; "


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes its tool calls."""

    name: str
    markers: tuple[str, ...]  # text that opens a run of calls
    end_marker: str | None = None  # text that may close one call (Hermes)
    markers_anywhere: bool = True  # False: calls open only at the start of the output (Llama 3)
    bare_json_start: bool = False  # a "{" or "[" at the start of the output opens calls
    # what in a chat template's text shows it writes this format, where a marker does not (None: a marker)
    template_evidence: re.Pattern[str] | None = None

    def written_by(self, chat_template: str) -> bool:
        """Whether ``chat_template``'s own text shows that its model writes calls in this format."""
        if self.template_evidence is not None:
            return self.template_evidence.search(chat_template) is not None
        return any(marker in chat_template for marker in self.markers)


FORMATS = {
    "hermes": ToolCallFormat("hermes", ("<tool_call>",), end_marker="</tool_call>"),
    "llama3_json": ToolCallFormat("llama3_json", ("<|python_tag|>",), markers_anywhere=False, bare_json_start=True),
    "mistral": ToolCallFormat("mistral", ("[TOOL_CALLS]",)),
    # read by pythonic_tool_parser; Llama 4's wrapper is no evidence (the token marks plain code too, nanochat's):
    # Meta's pythonic instruction "[func_name1(params_name1=..." or a template writing an earlier call as name(
    "pythonic": ToolCallFormat("pythonic", ("<|python_start|>",), end_marker="<|python_end|>", markers_anywhere=False,
                               template_evidence=re.compile(r"\[func_name1\(|\.name\s*[+~]\s*['\"]\(['\"]")),
}
# What ``tool_choice: required`` constrains the output to: a JSON array of {"name", "parameters"} objects.
REQUIRED_FORMAT = ToolCallFormat("required", (), markers_anywhere=False, bare_json_start=True)


class OutputParser(Protocol):
    """What the chat server reads one sample's output with: content and calls, fed a piece at a time."""

    @property
    def num_calls(self) -> int:
        """The calls said so far."""

    @property
    def num_invalid(self) -> int:
        """Calls (or their list's elements) that turned out to be none: the whole answer is then the text."""

    def feed(self, text: str) -> ParsedDelta:
        """What can be said of the output with ``text`` added."""

    def finish(self) -> ParsedDelta:
        """What was held back, at the output's end."""


class CallCheck(Protocol):
    """What the request declares, as a parser checks the calls it reads against it."""

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a function the request declares."""

    def accepts(self, name: str, arguments: dict[str, Any]) -> bool:
        """Whether a call of ``name`` may take these arguments."""


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its id and name once (the first delta of the call), then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def fold(deltas: ParsedDelta) -> tuple[str, list[ToolCall]]:
    """The content and the calls that a run of deltas adds up to."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas.tool_calls:
        if delta.index not in calls:
            calls[delta.index] = ToolCall(delta.id or new_call_id(), delta.name or "", "")
        calls[delta.index].arguments += delta.arguments
    return deltas.content, [calls[i] for i in sorted(calls)]


class _ObjectScan:
    """Walks one JSON object in ``text`` from ``start``, a character at a time across calls, and records where
    each top-level member's value lies. It checks structure only; the finished object is parsed by json."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.end: int | None = None  # one past the closing brace, once seen
        self.members: dict[str, list[int | None]] = {}  # key -> [value start, value end or None]
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "key"  # at depth 1: key, colon, value, scalar (a number or literal in progress), comma
        self._token_start = 0
        self._key: str | None = None

    def advance(self, text: str) -> None:
        while self.end is None and self.pos < len(text):
            self._step(text, self.pos)
            self.pos += 1

    def _step(self, text: str, i: int) -> None:
        c = text[i]
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_closed(text, i)
            return
        if c == '"':
            self._in_string = True
            if self._depth == 1 and self._expect in ("key", "value"):
                self._token_start = i
        elif c in "{[":
            self._depth += 1
            if self._depth == 2 and self._expect == "value":
                self._open_value(i)
        elif c in "}]":
            if self._depth == 1 and self._expect == "scalar":
                self._close_value(i)
            self._depth -= 1
            if self._depth == 1:
                self._close_value(i + 1)
            elif self._depth == 0:
                self.end = i + 1
        elif self._depth == 1:
            self._structural(c, i)

    def _structural(self, c: str, i: int) -> None:
        if c == ":" and self._expect == "colon":
            self._expect = "value"
        elif c == ",":
            if self._expect == "scalar":
                self._close_value(i)
            self._expect = "key"
        elif not c.isspace() and self._expect == "value":  # a number, true, false or null begins
            self._open_value(i)
            self._expect = "scalar"

    def _string_closed(self, text: str, i: int) -> None:
        if self._expect == "key":
            try:
                self._key = json.loads(text[self._token_start:i + 1])
            except json.JSONDecodeError:
                self._key = None
            self._expect = "colon"
        elif self._expect == "value":
            self._open_value(self._token_start)
            self._close_value(i + 1)

    def _open_value(self, i: int) -> None:
        # a repeated key keeps its first value: what a stream said of it before the repeat came, so that the
        # whole answer, scanned at once, says the same
        if self._key is not None and self._key not in self.members:
            self.members[self._key] = [i, None]

    def _close_value(self, i: int) -> None:
        span = self.members.get(self._key) if self._key is not None else None
        if span is not None and span[1] is None:
            span[1] = i
        self._key = None
        self._expect = "comma"

    def span(self, keys: tuple[str, ...]) -> list[int | None] | None:
        return next((self.members[k] for k in keys if k in self.members), None)


class TextStateMachine:
    """What the output parsers share: the output so far (``_text``), read up to ``_pos``, by the handler of the
    state it is in (``_handlers[_state]``), which says what it can into a ``ParsedDelta`` and moves on (its place,
    its state) or waits for more text."""

    def __init__(self, state: str, handlers: dict[str, Callable[[ParsedDelta], None]]) -> None:
        self._text = ""
        self._pos = 0  # everything before it has been said (or is held back)
        self._state = state
        self._handlers = handlers

    def feed(self, text: str) -> ParsedDelta:
        """What can be said of the output with ``text`` added: the handlers run while one moves on."""
        self._text += text
        out = ParsedDelta()
        while self._pos < len(self._text):
            before = (self._pos, self._state)
            self._handlers[self._state](out)
            if (self._pos, self._state) == before:  # waiting for more text
                break
        return out


class ToolCallParser(TextStateMachine):
    """Splits a model's output into content and tool calls of one ``ToolCallFormat``, incrementally.
    ``max_calls`` (1 when ``parallel_tool_calls`` is false) drops the calls after it; with ``check``, a call of
    a function the request does not declare is no call (its text is content), nor one whose arguments the
    check refuses. Whitespace between calls is neither."""

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None, check: CallCheck | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.check = check
        self._run_start = 0  # where the current run of calls began (its marker), while no call of it finished
        self._run_has_call = False
        self._content_after_run = False  # content was said since the last run of calls closed
        self._scan: _ObjectScan | None = None
        self._num_calls = 0
        # calls that were none: said ones (their name at least) whose whole text was no call (JSON, arguments an
        # object), and calls the check refused
        self.num_invalid = 0
        self._named = False  # the current call's id and name were said
        self._args_sent = 0
        super().__init__("start" if fmt.bare_json_start or not fmt.markers_anywhere else "content",
                         {"start": self._in_start, "text": self._in_text, "content": self._in_content,
                          "calls": self._in_calls, "object": self._in_object})

    @property
    def num_calls(self) -> int:
        return self._num_calls + self._named

    def finish(self) -> ParsedDelta:
        """The end of the output: held-back text is content; a call cut short keeps what was said of it (and
        counts as invalid: its object never closed)."""
        out = ParsedDelta()
        if self._state == "object" and self._named:
            self.num_invalid += 1
            return out
        if self._state in ("object", "calls") and not self._run_has_call:
            out.content += self._text[self._run_start:]
        elif self._state in ("content", "start"):
            out.content += self._between_calls(self._text[self._pos:])
        self._pos = len(self._text)
        return out

    # ---- states: start (nothing but whitespace yet), content, calls (between objects of a run), object ----

    def _in_start(self, out: ParsedDelta) -> None:
        rest = self._text[self._pos:].lstrip()
        if not rest:
            return
        if self.fmt.bare_json_start and rest[0] in "{[":
            self._open_run(len(self._text) - len(rest), 0)
            return
        marker = self._marker_at(rest)
        if marker is None and any(m.startswith(rest) for m in self.fmt.markers):
            return  # a marker may be coming
        if marker is not None:
            self._open_run(len(self._text) - len(rest), len(marker))
        elif self.fmt.markers_anywhere:
            self._state = "content"
        else:
            self._state = "text"  # Llama 3: no calls after the start; the rest is content

    def _in_text(self, out: ParsedDelta) -> None:
        out.content += self._text[self._pos:]
        self._pos = len(self._text)

    def _in_content(self, out: ParsedDelta) -> None:
        found = [(i, m) for m in self.fmt.markers if (i := self._text.find(m, self._pos)) >= 0]
        if found:
            i, marker = min(found)
            out.content += self._between_calls(self._text[self._pos:i])
            self._open_run(i, len(marker))
            return
        keep = max((_partial_suffix(self._text, m) for m in self.fmt.markers), default=0)
        end = len(self._text) - keep
        if not self._between_calls(self._text[self._pos:end]):
            return  # whitespace after a call: content only if more content follows
        out.content += self._text[self._pos:end]
        self._content_after_run = self._content_after_run or end > self._pos
        self._pos = end

    def _between_calls(self, text: str) -> str:
        """``text`` as content: none where it is only whitespace right after a call (OpenAI's calls come without
        it); whitespace after content that followed the calls is that content's, as a whole answer reads it."""
        return "" if self.num_calls and not self._content_after_run and not text.strip() else text

    def _in_calls(self, out: ParsedDelta) -> None:
        text, i = self._text, self._pos
        while i < len(text) and text[i] in _SEPARATORS:
            i += 1
        self._pos = i
        if i == len(text):
            return
        end_marker = self.fmt.end_marker
        if end_marker is not None and text.startswith(end_marker, i):
            self._pos = i + len(end_marker)
            self._close_run()
        elif end_marker is not None and end_marker.startswith(text[i:]):
            return  # the end marker may be coming
        elif text[i] == "{":
            self._scan = _ObjectScan(i)
            self._state = "object"
        elif not self._run_has_call:  # the marker opened no call after all: it was content
            out.content += text[self._run_start:i]
            self._close_run()
        else:
            self._close_run()

    def _in_object(self, out: ParsedDelta) -> None:
        scan = self._scan
        assert scan is not None
        scan.advance(self._text)
        self._pos = scan.pos
        if self._keeps_call():
            self._say_call(scan, out)
        if scan.end is not None:
            self._end_call(scan, out)

    # ---- calls ----

    def _open_run(self, start: int, marker_length: int) -> None:
        self._run_start = start
        self._run_has_call = False
        self._content_after_run = False
        self._pos = start + marker_length
        self._state = "calls"

    def _close_run(self) -> None:
        self._state = "content" if self.fmt.markers_anywhere else "text"

    def _keeps_call(self) -> bool:
        return self.max_calls is None or self._num_calls < self.max_calls

    def _say_call(self, scan: _ObjectScan, out: ParsedDelta) -> None:
        if not self._named:
            name = _string_member(self._text, scan, ("name",))
            if name is None or (self.check is not None and not self.check.knows(name)):
                return
            out.tool_calls.append(ToolCallDelta(self._num_calls, new_call_id(), name))
            self._named = True
        span = scan.span(ARGUMENT_KEYS)
        if span is not None:
            start, end = span
            assert start is not None
            available = (end if end is not None else scan.pos) - start  # an unclosed value is all arguments
            if available > self._args_sent:
                piece = self._text[start + self._args_sent:start + available]
                out.tool_calls.append(ToolCallDelta(self._num_calls, arguments=piece))
                self._args_sent = available

    def _end_call(self, scan: _ObjectScan, out: ParsedDelta) -> None:
        assert scan.end is not None
        valid = self._is_call(self._text[scan.start:scan.end])
        if self._named:
            if self._args_sent == 0:
                out.tool_calls.append(ToolCallDelta(self._num_calls, arguments="{}"))
            self._num_calls += 1
            self.num_invalid += not valid
            self._run_has_call = True
        elif valid and not self._keeps_call():
            self._run_has_call = True  # a call past max_calls: dropped
        elif not valid and not self._run_has_call:
            out.content += self._text[self._run_start:scan.end]
            self._close_run()
            # a call of an undeclared function, left as content: the whole answer is the model's text, as for a
            # strict function's call whose arguments the check refused
            self.num_invalid += self._is_undeclared_call(scan)
        elif not valid:  # among the run's calls, an object that is no call: the whole answer is the model's text
            self.num_invalid += 1
        self._scan = None
        self._named = False
        self._args_sent = 0
        if self._state == "object":
            self._state = "calls"

    def _is_call(self, text: str) -> bool:
        """Whether ``text`` is a call as OpenAI's clients read one (``_call``), and one the check lets through."""
        call = _call(text)
        return call is not None and (self.check is None or (self.check.knows(call[0]) and self.check.accepts(*call)))

    def _is_undeclared_call(self, scan: _ObjectScan) -> bool:
        call = _call(self._text[scan.start:scan.end])
        return call is not None and self.check is not None and not self.check.knows(call[0])

    def _marker_at(self, text: str) -> str | None:
        return next((m for m in self.fmt.markers if text.startswith(m)), None)


class NamedToolCallParser:
    """``tool_choice`` naming a function: the whole output, constrained to its parameters' schema, is the
    arguments of one call."""

    num_invalid = 0  # the grammar wrote the arguments

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    @property
    def num_calls(self) -> int:
        return int(self._started)

    def feed(self, text: str) -> ParsedDelta:
        """The call opened by its first text: an output cut before any (in its thinking) made no call, as under
        ``required``."""
        out = ParsedDelta()
        if not text:
            return out
        if not self._started:
            out.tool_calls.append(ToolCallDelta(0, new_call_id(), self.name))
            self._started = True
        out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> ParsedDelta:
        return self.feed("")


def parse_tool_calls(parser: OutputParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls (the same deltas a stream of it gives, folded)."""
    deltas = parser.feed(text)
    deltas.extend(parser.finish())
    return fold(deltas)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (and is shorter than it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _string_member(text: str, scan: _ObjectScan, keys: tuple[str, ...]) -> str | None:
    span = scan.span(keys)
    if span is None or span[1] is None:
        return None
    assert span[0] is not None
    try:
        value: Any = json.loads(text[span[0]:span[1]])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _call(text: str) -> tuple[str, dict[str, Any]] | None:
    """``text`` as a call as OpenAI's clients read one, (name, arguments): a name, and arguments (if any) an
    object; None if it is not one."""
    try:
        value = json.loads(text, object_pairs_hook=_KeysFirstSeen)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, _KeysFirstSeen) or not isinstance(value.first.get("name"), str):
        return None
    arguments = next((value.first[key] for key in ARGUMENT_KEYS if key in value.first), {})
    return (value.first["name"], arguments) if isinstance(arguments, dict) else None


class _KeysFirstSeen(dict):
    """A JSON object as ``json.loads`` makes it (a repeated key: its last value, as a client reads arguments),
    with each key's first value too: the call's own name and arguments are the first, as the stream said them."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.first: dict[str, Any] = {}
        for key, value in pairs:
            self.first.setdefault(key, value)
