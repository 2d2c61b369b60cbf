"""Which positions of a sample get a logprob entry, how an entry's token is spelled for a client, and, over
HTTP, the bound --max-logprobs puts on both endpoints and a processed --logprobs-mode's masked tokens."""

from __future__ import annotations

import httpx
import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvserve.outputs import Logprob
from kvserve.server.logprobs import MASKED_LOGPROB, text_positions, token_spelling, top_entries
from kvserve.server.streaming import SampleDelta
from tests.engine.byte_bpe import byte_bpe_tokenizer
from tests.server.conftest import MODEL_NAME, ServerProcess

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


def test_minus_one_takes_every_entry_a_position_holds() -> None:
    position = {t: Logprob(-float(rank), rank) for rank, t in enumerate([5, 3, 9, 1], start=1)}
    assert [t for t, _ in top_entries(position, -1)] == [5, 3, 9, 1]
    assert [t for t, _ in top_entries(position, 2)] == [5, 3]


@pytest.fixture(scope="module")
def processed_server(start_server) -> ServerProcess:
    return start_server("--max-logprobs", "3", "--logprobs-mode", "processed_logprobs")


@pytest.mark.parametrize("path, fields, param", [
    ("chat/completions", {"logprobs": True, "top_logprobs": 4}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),  # the vocabulary's 512
    ("chat/completions", {"prompt_logprobs": 4}, "prompt_logprobs"),
    ("completions", {"logprobs": 4}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"prompt_logprobs": 5}, "prompt_logprobs"),
])
def test_more_alternatives_than_max_logprobs_are_a_400_naming_the_field(
        processed_server: ServerProcess, path: str, fields: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 2, **fields}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") else {"prompt": "hi"}
    answer = httpx.post(f"{processed_server.url}/v1/{path}", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and "more than the 3 that max_logprobs allows" in error["message"], error
    asked = {**body, **{name: 3 for name, value in fields.items() if not isinstance(value, bool)}}
    assert httpx.post(f"{processed_server.url}/v1/{path}", json=asked, timeout=30).status_code == 200


def test_a_processed_mode_gives_the_tokens_top_k_masked_vllms_stand_in_for_minus_infinity(
        processed_server: ServerProcess) -> None:
    """top_k 2: the third most likely token of each position is masked, its logprob -inf, which JSON carries as
    vLLM's -9999.0 on both endpoints; the two kept share the whole probability."""
    sampling = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 1.0, "top_k": 2, "seed": 3, "ignore_eos": True}
    chat = httpx.post(f"{processed_server.url}/v1/chat/completions", timeout=30, json={
        **sampling, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3}).json()
    for entry in chat["choices"][0]["logprobs"]["content"]:
        *_, masked = (top["logprob"] for top in entry["top_logprobs"])
        assert masked == MASKED_LOGPROB and entry["logprob"] > MASKED_LOGPROB
        assert sum(2.718281828 ** top["logprob"] for top in entry["top_logprobs"]) == pytest.approx(1.0)
    completion = httpx.post(f"{processed_server.url}/v1/completions", timeout=30,
                            json={**sampling, "prompt": "hi", "logprobs": 3}).json()
    for top in completion["choices"][0]["logprobs"]["top_logprobs"]:
        assert sorted(top.values())[0] == MASKED_LOGPROB
