"""Incremental detokenization: one sample's output tokens -> text deltas, never half a character.

A byte-level tokenizer may split one character over several tokens, and decoding a token alone may not give
its text in context (SentencePiece drops a word's leading space at the start). So each update decodes a
small window that starts a few tokens back and emits only what is new::

    window:  | context: tokens emitted last time (or the prompt tail*) | new, not yet emitted |
             0                                                        ^ read_offset         ^ len

    new text = decode(window) minus decode(window[:read_offset])

After an emission the window restarts at the tokens just emitted, which become the next context. (* Less the
tokens of a character the prompt leaves incomplete.)
If the window's text ends in U+FFFD (the replacement character: an incomplete UTF-8 sequence), or its last token
is a SentencePiece byte-fallback token (``<0xE2>``: such a run decodes whole, an invalid one to a U+FFFD a byte),
nothing is emitted and the window grows until the character, or the run, ends. A U+FFFD may also stand for bytes
that are never valid (a byte-level BPE model emitting lone continuation bytes, which a ``logit_bias`` can force):
once the held tokens are more than a character's bytes could span, those whose bytes can no longer change (up to
the last point where no character is left open) are emitted, so the window stays short (else every token decoded
the whole run twice: quadratic). Special tokens that the decode skips are left out of the window, as the decode
drops them before its decoder runs, so a run goes on across them: they are looked through. ``flush`` emits
whatever is still held at the end, so the concatenated deltas always equal decoding all the output tokens at once
(but for a decoder that strips a text's first space, Llama 2's: the output's first word follows the prompt's
context, so it keeps its space, as in vLLM).
Decoding never cleans up tokenization spaces: that rewrites text across window boundaries.
"""

from __future__ import annotations

import codecs
import functools
import re
from typing import Any, Sequence

from transformers import PreTrainedTokenizerBase

NUM_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output, as vLLM does
MAX_CHAR_BYTES = 4  # a UTF-8 character's: more held tokens than this (a byte at least each) hold settled bytes
REPLACEMENT_CHAR = "\ufffd"
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDetokenizer:
    """The text of one sample, built token by token. Not thread-safe; owned by the output processor."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a fast tokenizer's own (Rust) decode is what its ``decode`` calls, less ~10 us of Python around it: at
        # two decodes per token per sample, that Python was most of a large decode step's host time
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_tokens = byte_fallback_tokens(tokenizer)
        self._skipped = special_tokens(tokenizer) if skip_special_tokens else frozenset()
        self.window = self._prompt_context(prompt_token_ids)
        self.read_offset = len(self.window)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last tokens, less a run of bytes at its end (a character the prompt leaves incomplete, or
        a byte-fallback run): the output's bytes would join it, and the text would then change inside the context
        (a character lost). Without them the output's first bytes decode as they do alone, as in decoding the
        output tokens at once."""
        context = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        while context and (context[-1] in self._byte_tokens or context[-1] in self._skipped
                           or self._decode(context).endswith(REPLACEMENT_CHAR)):
            context.pop()  # a skipped token is no text: popping it changes no decode, and reaches the bytes before
        return context

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (empty while a character is still incomplete)."""
        # a token the decode skips is dropped before its decoder runs: left out, it changes no text, and a run of
        # them after an open character held the whole run (each token decoding it again)
        self.window.extend(token for token in new_token_ids if token not in self._skipped)
        if self.window and self.window[-1] in self._byte_tokens:
            return ""  # a byte-fallback run decodes whole (an invalid one as a U+FFFD a byte): wait for its end
        prefix_text, full_text = self._window_texts()
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(REPLACEMENT_CHAR):
            return self._emit_settled(prefix_text, full_text)
        return self._emit(full_text[len(prefix_text):])

    def _emit_settled(self, prefix_text: str, full_text: str) -> str:
        """The text of the held tokens whose bytes no later token can change, where the held tokens are more than
        one incomplete character could span; "" while they are not."""
        held = self.window[self.read_offset:]
        if len(held) <= MAX_CHAR_BYTES or self._backend is None:  # a slow tokenizer's pieces: bytes not known
            return ""
        settled = _settled_tokens(held, self.tokenizer)
        if settled == len(held):  # the U+FFFD is of bytes never valid: all of it is final
            return self._emit(full_text[len(prefix_text):])
        if settled == 0:
            return ""
        delta = self._decode(self.window[:self.read_offset + settled])[len(prefix_text):]
        del self.window[:self.read_offset]  # the settled tokens are the next context; the rest stays held
        self.read_offset = settled
        return delta

    def flush(self) -> str:
        """Return the text held back for an incomplete character (it stays incomplete: the sample ended)."""
        prefix_text, full_text = self._window_texts()
        return self._emit(full_text[len(prefix_text):]) if len(full_text) > len(prefix_text) else ""

    def _window_texts(self) -> tuple[str, str]:
        return self._decode(self.window[:self.read_offset]), self._decode(self.window)

    def _emit(self, delta: str) -> str:
        del self.window[:self.read_offset]
        self.read_offset = len(self.window)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )


def _settled_tokens(token_ids: list[int], tokenizer: Any) -> int:
    """How many of ``token_ids`` (which start where a character may start) end where no character is left open:
    their text is final whatever follows (Python's UTF-8 decoder holds back exactly an incomplete sequence, as the
    tokenizers' lossy decode reads it: by maximal subparts)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    settled = 0
    for count, token_id in enumerate(token_ids, 1):
        decoder.decode(bytes(token_bytes(token_id, tokenizer)))
        if not decoder.getstate()[0]:
            settled = count
    return settled


def token_bytes(token_id: int, tokenizer: Any) -> list[int]:
    """A token's own bytes, what a client joins to rebuild text that tokens split inside a character (chat
    logprobs' ``bytes``): a byte-level BPE token's characters each stand for a byte, a SentencePiece byte-fallback
    token (``<0xE2>``) for its byte, and any other token for its text (``▁`` a space). An id past the tokenizer (a
    vocabulary padded past it, as Qwen2.5's 152,064 rows for ~151.7k tokens) has none, as its decode gives ''."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return []
    if decodes_byte_level(tokenizer):
        table = _unicode_to_byte()
        if all(char in table for char in piece):
            return [table[char] for char in piece]
    if BYTE_TOKEN.fullmatch(piece):
        return [int(piece[3:5], 16)]
    return list(piece.replace("\u2581", " ").encode("utf-8"))


@functools.lru_cache(maxsize=8)
def decodes_byte_level(tokenizer: Any) -> bool:
    """Whether a fast tokenizer's decoder is byte-level BPE's, alone or inside a sequence of decoders: its pieces'
    characters then stand for bytes (a wrapped one read as text split a character it held)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and '"type":"ByteLevel"' in decoder.__getstate__().decode()


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's table of byte-level BPE

    return {char: byte for byte, char in bytes_to_unicode().items()}


@functools.lru_cache(maxsize=8)
def byte_fallback_tokens(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids of a SentencePiece tokenizer's byte-fallback tokens (``<0xE2>``; none in a byte-level BPE one)."""
    return frozenset(i for token, i in tokenizer.get_vocab().items() if BYTE_TOKEN.fullmatch(token))


@functools.lru_cache(maxsize=8)
def special_tokens(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids that ``decode(..., skip_special_tokens=True)`` drops: the added tokens marked special."""
    return frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)


class TokenTextCache:
    """Each token decoded alone (special tokens included), for logprob entries; memoised per token id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        return text
