"""The tokens a request restricts its outputs to, or keeps out of them (vLLM's ``allowed_token_ids`` and
``bad_words``): two logits processors, each giving way in a row it would leave with no token to draw (another
restriction, a grammar, took the rest), where a row of -inf drew token 0, outside every restriction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvserve.device_copy import to_device
from kvserve.sample.metadata import SamplingRow
from kvserve.sample.processor import LogitsProcessor, ban_where_something_is_left, check_token_ids


class AllowedTokens(LogitsProcessor):
    """Every token but a row's ``allowed_token_ids`` to -inf. A request's ids go to the device once, at its first
    row (a list of tens of thousands, made into a tensor every step, cost a millisecond a row)."""

    is_stateful = True

    def __init__(self) -> None:
        self._ids: dict[str, torch.Tensor] = {}  # sample key -> its allowed ids, on the logits' device

    def is_needed(self, row: SamplingRow) -> bool:
        return row.params.allowed_token_ids is not None

    def reads_history(self, row: SamplingRow) -> bool:
        return False

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        needed = [i for i, row in enumerate(rows) if self.is_needed(row)]
        if not needed:
            return
        ids = [self._device_ids(rows[i], logits) for i in needed]
        lengths = _long([len(row_ids) for row_ids in ids], logits.device)
        segments = torch.repeat_interleave(torch.arange(len(needed), device=logits.device), lengths,
                                           output_size=sum(map(len, ids)))  # no sync for the size
        index = (_long(needed, logits.device)[segments], torch.cat(ids))
        kept = logits[index]
        finite = torch.zeros(len(needed), device=logits.device).index_add_(0, segments, kept.isfinite().float())
        masked = _long(needed, logits.device)[finite > 0]  # rows where an allowed token is still drawable
        logits[masked] = -float("inf")
        logits[index] = kept

    def _device_ids(self, row: SamplingRow, logits: torch.Tensor) -> torch.Tensor:
        ids = self._ids.get(row.generator_key)
        if ids is None:
            allowed = row.params.allowed_token_ids
            assert allowed is not None
            check_token_ids(allowed, logits.shape[1], "allowed_token_ids")
            ids = self._ids[row.generator_key] = _long(allowed, logits.device)
        return ids

    def drop(self, key: str) -> None:
        self._ids.pop(key, None)

    @property
    def num_states(self) -> int:
        return len(self._ids)


@dataclass
class _WordIndex:
    """A request's bad words by the length of the tokens before their last: what ends each."""

    always: list[int] = field(default_factory=list)  # one-token words: banned in every row
    by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)

    @classmethod
    def of(cls, words: Sequence[tuple[int, ...]]) -> _WordIndex:
        index = cls()
        for word in words:
            if len(word) == 1:
                index.always.append(word[0])
            else:
                index.by_prefix.setdefault(len(word) - 1, {}).setdefault(word[:-1], []).append(word[-1])
        return index

    def banned(self, history: Sequence[int]) -> list[int]:
        """The last tokens of the words whose other tokens end ``history``: one lookup per prefix length, not
        one comparison per word (1,024 words cost 2.6 ms a row a step compared one by one)."""
        banned = list(self.always)
        for length, endings in self.by_prefix.items():
            if len(history) >= length:
                banned += endings.get(tuple(history[len(history) - length:]), ())
        return banned


class BadWords(LogitsProcessor):
    """A bad word's last token to -inf in rows whose outputs end with the tokens before it (a one-token word: in
    every row), so that no output ends with the word (vLLM's ``bad_words``; the prompt is not looked at)."""

    is_stateful = True

    def __init__(self) -> None:
        self._words: dict[str, _WordIndex] = {}  # sample key -> its words, indexed

    def is_needed(self, row: SamplingRow) -> bool:
        return bool(row.params.bad_words_token_ids)

    def reads_history(self, row: SamplingRow) -> bool:
        return any(len(word) > 1 for word in row.params.bad_words_token_ids or ())

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        entries = [(i, token) for i, row in enumerate(rows) if self.is_needed(row)
                   for token in self._index(row).banned(row.output_token_ids)]
        if not entries:
            return
        row_ids, token_ids = zip(*entries)
        check_token_ids(token_ids, logits.shape[1], "bad_words")
        ban_where_something_is_left(logits, row_ids, token_ids)

    def _index(self, row: SamplingRow) -> _WordIndex:
        index = self._words.get(row.generator_key)
        if index is None:
            index = self._words[row.generator_key] = _WordIndex.of(row.params.bad_words_token_ids or ())
        return index

    def drop(self, key: str) -> None:
        self._words.pop(key, None)

    @property
    def num_states(self) -> int:
        return len(self._words)


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)
