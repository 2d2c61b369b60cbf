"""Incremental detokenization: streamed deltas add up to decoding everything, never half a character."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, TokenTextCache
from tests.engine.byte_bpe import SEP, byte_bpe_tokenizer

TEXTS = [
    "hello world 🙂🚀🎉 done",
    "你好世界，你好吗？",
    "naïve café 👍🏽 déjà vu",
    "🙂🙂🙂",
    "plain ascii only",
]


def stream(token_ids: list[int], prompt_ids: list[int] = (), skip_special_tokens: bool = True,
           chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(byte_bpe_tokenizer(), list(prompt_ids), skip_special_tokens)
    deltas = [detok.update(token_ids[i:i + chunk]) for i in range(0, len(token_ids), chunk)]
    return [*deltas, detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_add_up_to_the_full_decode_without_partial_characters(text, chunk):
    tok = byte_bpe_tokenizer()
    ids = tok.encode(text)
    deltas = stream(ids, prompt_ids=tok.encode("prompt 你"), chunk=chunk)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_multibyte_characters_are_held_until_complete():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("🙂🚀")
    assert len(ids) > 2  # the emoji really span several tokens
    deltas = stream(ids)
    assert [d for d in deltas if d] == ["🙂", "🚀"] or [d for d in deltas if d] == ["🙂🚀"]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(skip):
    tok = byte_bpe_tokenizer()
    ids = tok.encode("a 🙂") + [tok.convert_tokens_to_ids(SEP)] + tok.encode(" b") + [tok.eos_token_id]
    deltas = stream(ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("</s>" in "".join(deltas)) is not skip


def test_flush_emits_an_incomplete_character_at_the_end():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("ok 🚀")[:-1]  # cut inside the emoji
    deltas = stream(ids)
    emitted, flushed = "".join(deltas[:-1]), deltas[-1]
    assert emitted.startswith("ok") and REPLACEMENT_CHAR not in emitted
    assert flushed.endswith(REPLACEMENT_CHAR) and emitted + flushed == tok.decode(ids)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["a", " b", "é", "你", "好", "🙂", "🚀", "👍🏽", "\n", "the"]), max_size=12))
def test_any_mix_of_characters_streams_exactly(pieces):
    tok = byte_bpe_tokenizer()
    text = "".join(pieces)
    ids = tok.encode(text)
    deltas = stream(ids)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_token_text_cache_decodes_single_tokens():
    tok = byte_bpe_tokenizer()
    texts = TokenTextCache(tok)
    assert texts(tok.eos_token_id) == "</s>"
    token_id = tok.encode("hello")[0]
    assert texts(token_id) == tok.decode([token_id]) == texts(token_id)
