"""The text of logprob entries, for completions and chat alike: a token's text and bytes, which positions of a
sample get an entry, a position's most likely tokens, and their values as JSON carries them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvserve.engine.detokenizer import REPLACEMENT_CHAR, token_bytes
from kvserve.outputs import Logprob, PositionLogprobs

if TYPE_CHECKING:
    from kvserve.server.streaming import SampleDelta

# JSON has no -inf: vLLM's stand-in for it, the value of a token the request's processing masked
# (--logprobs-mode processed_*: top_k, a grammar, allowed_token_ids, ...)
MASKED_LOGPROB = -9999.0


def token_text(token_id: int, logprob: Logprob, tokenizer: Any) -> str:
    """A logprob entry's token as text: the detokenizer's piece if it gave one, else the token decoded alone."""
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def token_spelling(token_id: int, text: str, tokenizer: Any, as_token_id: bool = False) -> str:
    """A logprob entry's token as a client reads it: its ``text``, or, where it holds part of a character (its
    text a U+FFFD), its bytes escaped (``"\\xe2\\x82"``), as OpenAI spells such tokens: the partial tokens of a
    character are told apart, where as text they were all one "\ufffd". ``as_token_id`` (vLLM's
    ``return_tokens_as_token_ids``): ``"token_id:<id>"`` for every token, which names it whatever its text."""
    if as_token_id:
        return f"token_id:{token_id}"
    if REPLACEMENT_CHAR in text:
        return bytes(token_bytes(token_id, tokenizer)).decode("utf-8", errors="backslashreplace")
    return text


def entry_spelling(token_id: int, logprob: Logprob, tokenizer: Any, as_token_id: bool = False) -> str:
    """A logprob entry's token (``token_text``) as a client reads it (``token_spelling``)."""
    text = "" if as_token_id else token_text(token_id, logprob, tokenizer)  # spelled by its id: no decode needed
    return token_spelling(token_id, text, tokenizer, as_token_id)


def text_positions(delta: SampleDelta, include_stop_str_in_output: bool) -> list[tuple[int, PositionLogprobs]]:
    """The delta's tokens that are text, with their logprobs: an EOS or stop token that ended the sample stays in
    its token ids but is no text, so it gets no logprob entry (as in OpenAI's answers, whose entries spell the
    text). Every other sampled token keeps its entry, as in vLLM: those that completed a stop string cut from the
    text, and special tokens the text skips, so then the entries spell more than the text (``text_offset`` past
    its end) and stay one per token that usage counts."""
    positions = list(zip(delta.token_ids, delta.logprobs or []))
    ended_by_token = delta.finish_reason == "stop" and not isinstance(delta.stop_reason, str)
    return positions[:-1] if ended_by_token and positions and not include_stop_str_in_output else positions


def top_entries(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens at a position, most likely first (-1: all it holds, the whole vocabulary)."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    k = len(ranked) if k == -1 else k
    return [(token_id, lp) for token_id, lp in ranked if lp.rank <= k][:k]


def json_logprob(value: float) -> float:
    """A logprob entry's value as JSON carries it: -inf (a masked token) as ``MASKED_LOGPROB``, as vLLM does."""
    return max(value, MASKED_LOGPROB)
