"""Which positions of a sample get a logprob entry, and how an entry's token is spelled for a client."""

from __future__ import annotations

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvserve.outputs import Logprob
from kvserve.server.logprobs import text_positions, token_spelling
from kvserve.server.streaming import SampleDelta
from tests.engine.byte_bpe import byte_bpe_tokenizer

TOKEN_IDS = [10, 11, 2]  # the last one ended the sample where it was an EOS or a stop token


def finished(finish_reason: str, stop_reason: int | str | None) -> SampleDelta:
    logprobs = [{t: Logprob(-0.5, 1, None)} for t in TOKEN_IDS]
    return SampleDelta("text", list(TOKEN_IDS), logprobs, finish_reason, stop_reason, True)


@pytest.mark.parametrize("finish_reason, stop_reason, include_stop_str_in_output, num_entries", [
    ("stop", None, False, 2),  # an EOS is no text: no entry
    ("stop", 2, False, 2),  # nor a stop token
    ("stop", None, True, 3),  # unless the text includes it
    ("stop", 2, True, 3),
    ("stop", "b", False, 3),  # a stop string's last token is text (the string was cut from it): it keeps its entry
    ("length", None, False, 3),
])
def test_a_token_that_ended_the_sample_has_an_entry_only_if_it_is_text(
        finish_reason: str, stop_reason: int | str | None, include_stop_str_in_output: bool,
        num_entries: int) -> None:
    positions = text_positions(finished(finish_reason, stop_reason), include_stop_str_in_output)
    assert [token_id for token_id, _ in positions] == TOKEN_IDS[:num_entries]
    assert all(list(position) == [token_id] for token_id, position in positions)


def byte_level_token(tokenizer, data: bytes) -> int:
    """The id of the byte-level BPE token whose bytes are ``data``."""
    table = bytes_to_unicode()
    token_id = tokenizer.convert_tokens_to_ids("".join(table[byte] for byte in data))
    assert token_id != tokenizer.unk_token_id and token_id is not None
    return token_id


@pytest.mark.parametrize("data, spelling", [
    (b" \xf0\x9f", " \\xf0\\x9f"),  # a space and the first half of an emoji
    ("\u4e16".encode() + b"\xe7\x95", "\u4e16\\xe7\\x95"),  # a whole character and part of the next
    (b"\x99\x82", "\\x99\\x82"),  # the emoji's second half
    (b" the", " the"),  # whole characters: the text
])
def test_a_token_holding_part_of_a_character_is_spelled_by_its_bytes_even_next_to_whole_ones(
        data: bytes, spelling: str) -> None:
    tokenizer = byte_bpe_tokenizer()
    token_id = byte_level_token(tokenizer, data)
    assert token_spelling(token_id, tokenizer.decode([token_id]), tokenizer) == spelling
