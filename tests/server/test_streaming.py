"""SSE framing: a chunk is one line for any client, those that split lines as Python's str.splitlines does
(httpx's iter_lines) included."""

from __future__ import annotations

import json

from pydantic import BaseModel

from kvserve.server.streaming import sse


class Chunk(BaseModel):
    text: str


def test_a_chunk_whose_text_holds_line_separators_stays_one_line_and_parses_back() -> None:
    text = "a\x85b\u2028c\u2029d\x1ce\x0bf\ng\rh"  # every character str.splitlines ends a line at
    event = sse(Chunk(text=text))
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert event.startswith("data: ") and json.loads(event[len("data: "):]) == {"text": text}
