"""SSE framing: a chunk is one line for any client, those that split lines as Python's str.splitlines does
(httpx's iter_lines) included."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kvserve.server.chat_protocol import ChatChunkChoice, ChatCompletionChunk, DeltaMessage
from kvserve.server.completion_protocol import CompletionChoice, CompletionResponse
from kvserve.engine.detokenizer import token_bytes
from kvserve.server.streaming import TextEvents, sse
from tests.engine.byte_bpe import byte_bpe_tokenizer, byte_fallback_tokenizer


class Chunk(BaseModel):
    text: str


def test_a_chunk_whose_text_holds_line_separators_stays_one_line_and_parses_back() -> None:
    text = "a\x85b\u2028c\u2029d\x1ce\x0bf\ng\rh"  # every character str.splitlines ends a line at
    event = sse(Chunk(text=text))
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert event.startswith("data: ") and json.loads(event[len("data: "):]) == {"text": text}


def _chat_chunk(index: int, text: str) -> ChatCompletionChunk:
    return ChatCompletionChunk(id='chat-"\u2028', created=1, model="m\\", choices=[
        ChatChunkChoice(index=index, delta=DeltaMessage(content=text))])


def _completion_chunk(index: int, text: str) -> CompletionResponse:
    return CompletionResponse(id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=index, text=text)])


# every character JSON escapes, the line breaks sse escapes, and the rest of the code points but surrogates
TEXTS = st.text(st.one_of(st.sampled_from('"\\/\x00\x1f\x7f\x85\u2028\u2029\n\r\t\b\f\ufffd'),
                          st.characters(exclude_categories=("Cs",))))


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(TEXTS, min_size=1, max_size=4), index=st.integers(0, 3))
def test_a_text_event_is_the_event_its_models_render(texts: list[str], index: int) -> None:
    """A stream's text events are filled into JSON rendered once: byte for byte what the chunk's pydantic
    models render (escapes included), whatever the text, and with usage excluded or not."""
    for render, exclude in ((_chat_chunk, {"usage"}), (_chat_chunk, None), (_completion_chunk, {"usage"})):
        events = TextEvents(render, exclude)
        for text in texts:
            assert events.event(index, text) == sse(render(index, text), exclude)


@pytest.mark.parametrize("text", ["a 🙂 naïve", "你好 €", "plain"])
def test_tokens_bytes_join_into_the_text(text: str) -> None:
    """Chat logprobs' ``bytes``: a token's own bytes, so that tokens that split a character rebuild it (its
    text decoded alone is a U+FFFD)."""
    for tokenizer, token_ids in ((byte_bpe_tokenizer(), byte_bpe_tokenizer().encode(text)),
                                 (byte_fallback_tokenizer(),
                                  byte_fallback_tokenizer().encode(" " + text, add_special_tokens=False))):
        joined = b"".join(bytes(token_bytes(token_id, tokenizer)) for token_id in token_ids)
        assert joined.decode() == tokenizer.decode(token_ids)
