"""SSE framing: a chunk is one line for any client, those that split lines as Python's str.splitlines does
(httpx's iter_lines) included."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from kvserve.server.logprobs import token_bytes
from kvserve.server.streaming import sse
from tests.engine.byte_bpe import byte_bpe_tokenizer, byte_fallback_tokenizer


class Chunk(BaseModel):
    text: str


def test_a_chunk_whose_text_holds_line_separators_stays_one_line_and_parses_back() -> None:
    text = "a\x85b\u2028c\u2029d\x1ce\x0bf\ng\rh"  # every character str.splitlines ends a line at
    event = sse(Chunk(text=text))
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert event.startswith("data: ") and json.loads(event[len("data: "):]) == {"text": text}


@pytest.mark.parametrize("text", ["a 🙂 naïve", "你好 €", "plain"])
def test_tokens_bytes_join_into_the_text(text: str) -> None:
    """Chat logprobs' ``bytes``: a token's own bytes, so that tokens that split a character rebuild it (its
    text decoded alone is a U+FFFD)."""
    for tokenizer, token_ids in ((byte_bpe_tokenizer(), byte_bpe_tokenizer().encode(text)),
                                 (byte_fallback_tokenizer(),
                                  byte_fallback_tokenizer().encode(" " + text, add_special_tokens=False))):
        joined = b"".join(bytes(token_bytes(token_id, tokenizer)) for token_id in token_ids)
        assert joined.decode() == tokenizer.decode(token_ids)
