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
from kvserve.sample.processor import LogitsProcessor, ban_where_something_is_left, check_token_ids
from kvserve.sample.restrictions import AllowedTokens, BadWords


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
        ban_where_something_is_left(logits, row_ids, token_ids)


def _banned_token_ids(row: SamplingRow) -> list[int]:
    if row.position >= row.params.min_tokens:
        return []
    eos = () if row.params.ignore_eos else row.eos_token_ids
    return sorted(set(eos).union(row.params.stop_token_ids))


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)
