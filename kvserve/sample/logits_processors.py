"""The logits processors and their order: the history and constraint transforms the sampler applies, in place,
to a step's fp32 logits [N, V] before the greedy/random split, behind one interface (``sample/processor.py``).

They run in the order of ``default_processors()``: the tokens a request allows, its logit bias, its bad words, the
min_tokens ban, then the penalties (repetition over prompt + outputs, presence and frequency over outputs;
``sample/penalties.py``).
Each touches only the rows that need it, with per-row values travelling as [R, 1] tensors. Truncation
(temperature, min-p, top-k/p) is not a processor: it belongs to the draw (``sample/truncation.py``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvserve.device_copy import to_device
from kvserve.sample.metadata import SamplingRow
from kvserve.sample.penalties import Penalties
from kvserve.sample.processor import LogitsProcessor, check_token_ids


def default_processors(grammar: LogitsProcessor | None = None) -> list[LogitsProcessor]:
    """A fresh set of processors, in the order they run. The bias runs before the min_tokens ban, so no bias
    can lift a banned EOS; the penalties run last, on biased logits, as in vLLM."""
    return [
        # Structured output's grammar mask (sample/grammar.py) first: it only turns disallowed tokens into -inf,
        # which every processor below keeps at -inf, so they all work on the allowed tokens alone.
        *([grammar] if grammar is not None else []),
        AllowedTokens(),
        LogitBias(),
        BadWords(),
        MinTokensBan(),
        Penalties(),
    ]


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
        lengths = [len(row_ids) for row_ids in ids]
        row_index = torch.repeat_interleave(_long(needed, logits.device), _long(lengths, logits.device),
                                            output_size=sum(lengths))  # no sync for the size
        index = (row_index, torch.cat(ids))
        kept = logits[index]
        logits[_long(needed, logits.device)] = -float("inf")
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


class BadWords(LogitsProcessor):
    """A bad word's last token to -inf in rows whose outputs end with the tokens before it (a one-token word: in
    every row), so that no output ends with the word (vLLM's ``bad_words``; the prompt is not looked at)."""

    def is_needed(self, row: SamplingRow) -> bool:
        return bool(row.params.bad_words_token_ids)

    def reads_history(self, row: SamplingRow) -> bool:
        return any(len(word) > 1 for word in row.params.bad_words_token_ids or ())

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        entries = [(i, word[-1]) for i, r in enumerate(rows) for word in r.params.bad_words_token_ids or ()
                   if _ends_with(r.output_token_ids, word[:-1])]
        if not entries:
            return
        row_ids, token_ids = zip(*entries)
        check_token_ids(token_ids, logits.shape[1], "bad_words")
        logits[_long(row_ids, logits.device), _long(token_ids, logits.device)] = -float("inf")


def _ends_with(history: Sequence[int], tokens: tuple[int, ...]) -> bool:
    if not tokens:
        return True
    return len(history) >= len(tokens) and tuple(history[len(history) - len(tokens):]) == tokens


class LogitBias(LogitsProcessor):
    """Adds each row's ``logit_bias[token]`` to its logit."""

    def is_needed(self, row: SamplingRow) -> bool:
        return bool(row.params.logit_bias)

    def reads_history(self, row: SamplingRow) -> bool:
        return False

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        entries = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()]
        if not entries:
            return
        row_ids, token_ids, biases = zip(*entries)
        check_token_ids(token_ids, logits.shape[1], "logit_bias")
        index = (_long(row_ids, logits.device), _long(token_ids, logits.device))
        logits.index_put_(index, to_device(biases, logits.dtype, logits.device), accumulate=True)


class MinTokensBan(LogitsProcessor):
    """Masks EOS (unless ignored) and stop tokens to -inf in rows that draw an output before ``min_tokens``
    (their ``position``: what they ban depends on how many tokens they have, not on which). A row the ban would
    leave with no token to draw (a grammar that allows only its end) keeps them: the constraint ends the output
    before ``min_tokens``, where a row of -inf drew token 0, outside the grammar."""

    def is_needed(self, row: SamplingRow) -> bool:
        p = row.params
        if row.position >= p.min_tokens:
            return False
        return bool(p.stop_token_ids) or (not p.ignore_eos and bool(row.eos_token_ids))

    def reads_history(self, row: SamplingRow) -> bool:
        return False

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        entries = [(i, t) for i, r in enumerate(rows) for t in _banned_token_ids(r)]
        if not entries:
            return
        row_ids, token_ids = zip(*entries)
        check_token_ids(token_ids, logits.shape[1], "eos / stop_token_ids")
        index = (_long(row_ids, logits.device), _long(token_ids, logits.device))
        kept = logits[index]
        logits[index] = -float("inf")
        rows = sorted(set(row_ids))  # each banned row read once, whatever it bans
        alive = torch.isfinite(logits[_long(rows, logits.device)]).any(dim=1)  # no host sync
        where = {row: i for i, row in enumerate(rows)}
        stuck = ~alive[_long([where[row] for row in row_ids], logits.device)]  # per entry: its row has nothing left
        logits[index] = torch.where(stuck, kept, logits[index])


def _banned_token_ids(row: SamplingRow) -> list[int]:
    if row.position >= row.params.min_tokens:
        return []
    eos = () if row.params.ignore_eos else row.eos_token_ids
    return sorted(set(eos).union(row.params.stop_token_ids))


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)
