"""Tool calls written as a Python list of calls, the ``pythonic`` format of Llama 3.2 (with its pythonic chat
template), ToolACE and Llama 4: ``[get_weather(city="Oslo", unit="celsius"), get_time()]``, Llama 4 wrapping it
in ``<|python_start|>`` ... ``<|python_end|>``.

The list opens only at the start of the output (after whitespace), as vLLM's ``pythonic`` parser reads it. Each
element is a call once the ``,`` or ``]`` after it is written: a name, keyword arguments only, each value a Python
literal as ``ast.literal_eval`` reads it (strings in either quote style with their escapes, numbers, True / False /
None, lists, tuples, dicts, nested), its ``arguments`` the JSON object of them (``json.dumps``, as vLLM writes
them). A call's id, name and arguments are said together when it closes, as vLLM streams them: only then is it
known to be a call. Text that may still open the list (``<|python_sta`` at the end of a delta) and a list's
unclosed element wait; text that is no list of calls is content as written.

An element that is no call (positional arguments, a value that is no literal: a name, an f-string, a call; a
value JSON cannot hold: a set, bytes, a complex number, NaN or an infinity, an integer past Python's 4,300-digit
conversion limit; a repeated keyword; a call of a function the request does not declare, or one the check refuses;
Python source that will not parse, nested too deep or too long a chain: ``ast``'s SyntaxError, RecursionError,
MemoryError) makes the list no call where it comes first: the whole output is content, as vLLM answers. After a
call it counts in ``num_invalid`` (the chat server then answers the whole output as content; a stream has said the
calls before it). Text after the list (and its ``<|python_end|>``) is content; whitespace around calls is not.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any

from kvserve.server.tool_parsers import CallCheck, ParsedDelta, TextStateMachine, ToolCallDelta, new_call_id

START = "<|python_start|>"
END = "<|python_end|>"
_OPENERS, _CLOSERS, _QUOTES = "([{", ")]}", "'\""
_NON_BLANK = re.compile(r"\S")


class _ElementScan:
    """Walks one element of the list from ``start``, a character at a time across deltas, to the ``,`` or ``]``
    that ends it outside brackets and strings. It only finds the end; ``ast`` reads the element."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.end: int | None = None  # where the separator lies, once seen
        self._depth = 0
        self._quote: str | None = None  # the open string's delimiter: ', ", ''' or """
        self._escape = False

    def advance(self, text: str) -> None:
        while self.end is None and self.pos < len(text):
            step = self._step(text, self.pos)
            if step == 0:  # quotes at the end of the text that may be three: wait for the next delta
                return
            self.pos += step

    def _step(self, text: str, i: int) -> int:
        """How many characters from ``i`` are read (0: none yet)."""
        if self._quote is not None:
            return self._in_string(text, i)
        c = text[i]
        if c in _QUOTES:
            if text.startswith(c * 3, i):
                self._quote = c * 3
            elif (c * 3).startswith(text[i:i + 3]):
                return 0
            else:
                self._quote = c
            return len(self._quote)
        if c in _OPENERS:
            self._depth += 1
        elif c in _CLOSERS and self._depth > 0:
            self._depth -= 1
        elif c in ",]" and self._depth == 0:  # a stray ")" or "}" stays in the element, which ast refuses
            self.end = i
        return 1

    def _in_string(self, text: str, i: int) -> int:
        quote = self._quote
        assert quote is not None
        if self._escape:  # a backslash keeps the next character in the string, a raw string's too
            self._escape = False
        elif text[i] == "\\":
            self._escape = True
        elif text.startswith(quote, i):
            self._quote = None
            return len(quote)
        elif text[i] == quote[0] and quote.startswith(text[i:i + 3]):
            return 0
        return 1


class PythonicToolCallParser(TextStateMachine):
    """Splits a model's output into content and the calls of a pythonic list, incrementally (``feed`` each new
    piece, ``finish`` at the end), as ``tool_parsers.ToolCallParser`` does for the JSON formats: the whole answer
    is the same deltas folded. ``max_calls`` drops the calls after it; ``check`` (the request's tools) makes a
    call of another function, or one whose arguments it refuses, no call."""

    def __init__(self, max_calls: int | None = None, check: CallCheck | None = None) -> None:
        self.max_calls = max_calls
        self.check = check
        self._element: _ElementScan | None = None
        self._elements = 0  # elements of the list read so far
        self._run_has_call = False  # a call of the list was said or dropped past max_calls
        self._num_calls = 0
        self.num_invalid = 0  # elements that were no call
        self._said_text = False  # content after the calls was said
        self._blank_to = 0  # the text from _pos to here is whitespace (read once however long it grows)
        super().__init__("start", {"start": self._in_start, "wrapper": self._in_wrapper, "list": self._in_list,
                                   "after": self._in_after, "text": self._in_text})

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def finish(self) -> ParsedDelta:
        """The end of the output: held-back text is content; a list cut short keeps the calls it said (and counts
        as invalid: it never closed), or is content where it said none."""
        out = ParsedDelta()
        if self._state in ("wrapper", "list") and self._run_has_call:
            self.num_invalid += 1
        elif self._state in ("wrapper", "list"):
            out.content += self._text
        elif not self._num_calls or self._said_text or self._first_non_blank() is not None:
            out.content += self._text[self._pos:]  # whitespace after the calls is none (OpenAI's calls come without)
        self._pos = len(self._text)
        return out

    # ---- states: start (nothing but whitespace yet), wrapper (after <|python_start|>), list, after (the list
    # closed), text (the rest is content) ----

    def _first_non_blank(self) -> int | None:
        """Where the text from ``_pos`` stops being whitespace; None while it is all whitespace."""
        found = _NON_BLANK.search(self._text, max(self._pos, self._blank_to))
        if found is None:
            self._blank_to = len(self._text)
            return None
        return found.start()

    def _in_start(self, out: ParsedDelta) -> None:
        at = self._first_non_blank()
        if at is None:
            return
        if self._text.startswith("[", at):
            self._open_list(at)
        elif self._text.startswith(START, at):
            self._pos, self._state = at + len(START), "wrapper"
        elif not START.startswith(self._text[at:at + len(START)]):
            self._state = "text"

    def _in_wrapper(self, out: ParsedDelta) -> None:
        at = self._first_non_blank()
        if at is not None and self._text.startswith("[", at):
            self._open_list(at)
        elif at is not None:  # Llama 4's wrapper around no list: the model's text
            self._pos, self._state = 0, "text"

    def _open_list(self, at: int) -> None:
        self._pos, self._state = at + 1, "list"
        self._element = _ElementScan(self._pos)

    def _in_list(self, out: ParsedDelta) -> None:
        element = self._element
        assert element is not None
        element.advance(self._text)
        if element.end is None:
            return
        text, closes = self._text[element.start:element.end], self._text[element.end] == "]"
        self._pos = element.end + 1
        self._element = _ElementScan(self._pos)
        if closes and not text.strip() and self._elements:  # a trailing comma
            self._state = "after"
            return
        self._elements += 1
        call = self._call(text)
        if call is not None:
            self._say(call, out)
        else:
            self.num_invalid += 1
            if not self._run_has_call:  # the list opened with no call: it was the model's text
                self._pos, self._state = 0, "text"
                return
        if closes:
            self._state = "after"

    def _call(self, text: str) -> tuple[str, str] | None:
        """``text`` as a call the request lets through: its name and JSON arguments."""
        call = read_call(text)
        if call is None:
            return None
        name, arguments = call
        if self.check is not None and not (self.check.knows(name) and self.check.accepts(name, json.loads(arguments))):
            return None
        return call

    def _say(self, call: tuple[str, str], out: ParsedDelta) -> None:
        self._run_has_call = True
        if self.max_calls is None or self._num_calls < self.max_calls:
            out.tool_calls.append(ToolCallDelta(self._num_calls, new_call_id(), *call))
            self._num_calls += 1

    def _in_after(self, out: ParsedDelta) -> None:
        at = self._first_non_blank()
        if at is None:
            return
        if self._text.startswith(END, at):
            self._pos, self._state = at + len(END), "text"
        elif not END.startswith(self._text[at:at + len(END)]):
            self._state = "text"

    def _in_text(self, out: ParsedDelta) -> None:
        """The rest is content; whitespace right after the calls only once text follows it."""
        if self._num_calls and not self._said_text and self._first_non_blank() is None:
            return
        out.content += self._text[self._pos:]
        self._pos = len(self._text)
        self._said_text = True


# the file name a model's text is parsed under: its warnings (an invalid escape, "C:\d", which Python reads as
# written) are filtered out by it, once, where ``catch_warnings`` around each parse would swap the process's filters
# under other threads
_SOURCE_NAME = "<kvserve tool call>"
warnings.filterwarnings("ignore", module=re.escape(_SOURCE_NAME))


def read_call(text: str) -> tuple[str, str] | None:
    """``text`` as a pythonic call, ``name(keyword=literal, ...)``: its name and its arguments as JSON text; None
    where it is none (see the module's docstring)."""
    try:
        node = ast.parse(text.strip(), filename=_SOURCE_NAME, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        names = [keyword.arg for keyword in node.keywords]
        if None in names or len(set(names)) < len(names):  # **mapping, a repeated keyword
            return None
        arguments: dict[str, Any] = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
