"""Incremental detokenization: streamed deltas add up to decoding everything, never half a character."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, TokenTextCache
from tests.engine.byte_bpe import BOS, EOS, SEP, byte_bpe_tokenizer, byte_fallback_tokenizer

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


def test_a_prompt_that_ends_inside_a_character_costs_the_output_none_of_its_text():
    """A client continuing a reply cut inside an emoji sends its bytes back in the prompt: the output's bytes
    complete that character, which must not shift the output's text (its first characters were lost)."""
    tok = byte_bpe_tokenizer()
    ids = tok.encode("Hi 🙂🚀 x y")
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(REPLACEMENT_CHAR)]
    assert cuts  # the emoji are split over several tokens
    for k in cuts:
        assert "".join(stream(ids[k:], prompt_ids=ids[:k])) == tok.decode(ids[k:])


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.sampled_from(["<0xE2>", "<0x82>", "<0xAC>", "<0xC3>", "▁", "a", BOS]), max_size=6),
       output=st.lists(st.sampled_from(["<0xE2>", "<0x82>", "<0xAC>", "<0xC3>", "<0xF0>", "▁x", "b", EOS]),
                       min_size=1, max_size=8),
       skip_special_tokens=st.booleans())
@example(prompt=[], output=["<0xC3>", "<0x82>", EOS, "<0x82>"], skip_special_tokens=True)
@example(prompt=["a", "<0xC3>", "<0x82>", BOS], output=["<0x82>"], skip_special_tokens=True)
def test_byte_fallback_runs_stream_as_they_decode_whole(prompt, output, skip_special_tokens):
    """SentencePiece's byte-fallback decoder reads a run of byte tokens whole, an invalid run as a U+FFFD a byte:
    a character emitted as soon as its bytes looked complete could be taken back by the next byte. A special
    token that the decode skips is dropped before the decoder, so a run goes on across it: ``<0x61> </s> <0x80>``
    is two U+FFFD, not "a" and one."""
    tok = byte_fallback_tokenizer()
    prompt_ids, output_ids = tok.convert_tokens_to_ids(prompt), tok.convert_tokens_to_ids(output)
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
    deltas = [detok.update([token]) for token in output_ids]
    assert "".join([*deltas, detok.flush()]) == tok.decode(output_ids, skip_special_tokens=skip_special_tokens)


def _byte_tokens(tok) -> dict[int, int]:
    """byte -> the id of the byte-level BPE token that is that byte alone."""
    from kvserve.engine.detokenizer import token_bytes

    return {token_bytes(i, tok)[0]: i for i in range(len(tok)) if len(token_bytes(i, tok)) == 1}


@settings(max_examples=300, deadline=None)
@given(data=st.lists(st.one_of(st.sampled_from([0x80, 0xBF, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x99, 0x82,
                                                0xFF, 0xC0, 0xED, 0xA0]),
                               st.integers(0, 255)), max_size=40),
       chunk=st.integers(1, 6), prompt=st.sampled_from(["", "a", "你"]))
@example(data=[0x80] * 5 + [0xE2, 0x82, 0xAC], chunk=1, prompt="")
@example(data=[0xE2, 0x82, 0xAC, 0xE2, 0x82, 0x80, 0x80, 0x80, 0x80, 0xAC], chunk=1, prompt="")
def test_any_bytes_of_a_byte_level_model_stream_as_they_decode_whole(data: list[int], chunk: int,
                                                                    prompt: str) -> None:
    """Byte tokens in any order, valid UTF-8 or not: the deltas add up to decoding them at once, whatever the
    steps' sizes, including where never-valid bytes come before and after characters."""
    tok = byte_bpe_tokenizer()
    ids = [_byte_tokens(tok)[byte] for byte in data]
    deltas = stream(ids, prompt_ids=tok.encode(prompt), chunk=chunk)
    assert "".join(deltas) == tok.decode(ids) == bytes(data).decode("utf-8", errors="replace")


def test_a_run_of_never_valid_bytes_is_emitted_as_it_comes_not_held_to_its_end() -> None:
    """A byte-level model emitting lone continuation bytes (a `logit_bias` can force it) held its whole run, every
    token decoding it twice: 7 ms a token at 16k tokens. Held now: at most a character's bytes."""
    tok = byte_bpe_tokenizer()
    detok = IncrementalDetokenizer(tok, [])
    lone = _byte_tokens(tok)[0x80]
    emitted = "".join(detok.update([lone]) for _ in range(1000))
    assert emitted == REPLACEMENT_CHAR * len(emitted) and len(emitted) >= 1000 - 5
    assert len(detok.window) <= 2 * 5  # the context and the held tokens
    assert emitted + detok.flush() == REPLACEMENT_CHAR * 1000


def test_a_byte_level_decoder_inside_a_sequence_is_read_as_bytes() -> None:
    """A tokenizer whose ByteLevel decoder sits in a `decoders.Sequence` decodes alike, but its pieces were read as
    text: 4 lone bytes then a euro sign streamed "\ufffd" * 5 and lost the euro."""
    import copy

    from tokenizers import decoders

    tok = copy.deepcopy(byte_bpe_tokenizer())
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel()])
    ids = [_byte_tokens(byte_bpe_tokenizer())[byte] for byte in [0x80] * 4 + [0xE2, 0x82, 0xAC]]
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.update([token]) for token in ids]
    assert "".join([*deltas, detok.flush()]) == tok.decode(ids) == REPLACEMENT_CHAR * 4 + "€"


def test_a_run_of_skipped_special_tokens_after_an_open_character_is_not_held() -> None:
    """Each skipped special token stayed in the window behind an open byte: every token decoded the run again."""
    tok = byte_bpe_tokenizer()
    sep = tok.convert_tokens_to_ids(SEP)
    ids = [_byte_tokens(tok)[0xE2]] + [sep] * 1000 + [_byte_tokens(tok)[0x82], _byte_tokens(tok)[0xAC]]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = [detok.update([token]) for token in ids[:-2]]
    assert len(detok.window) <= 2 and not any(deltas)
    deltas += [detok.update([token]) for token in ids[-2:]]
    assert "".join([*deltas, detok.flush()]) == tok.decode(ids, skip_special_tokens=True) == "€"


def test_ids_past_the_tokenizer_decode_to_nothing_as_the_tokenizer_decodes_them() -> None:
    """A model's vocabulary padded past its tokenizer (Qwen2.5: 152,064 rows, ~151.7k tokens) may sample an id the
    tokenizer lacks: ``token_bytes`` iterated None, and the step failed every request in it."""
    from kvserve.engine.detokenizer import token_bytes

    tok = byte_bpe_tokenizer()
    padded = len(tok) + 7
    assert token_bytes(padded, tok) == [] and tok.decode([padded]) == ""
    ids = [_byte_tokens(tok)[0xE2]] + [padded] * 12 + [_byte_tokens(tok)[0x82], _byte_tokens(tok)[0xAC]]
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.update([token]) for token in ids]
    assert "".join([*deltas, detok.flush()]) == tok.decode(ids)
