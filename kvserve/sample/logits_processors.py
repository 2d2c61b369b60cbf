"""Logits processors: the history and constraint transforms the sampler applies, in place, to a step's fp32
logits [N, V] before the greedy/random split, behind one interface (``LogitsProcessor``).

They run in the order of ``default_processors()`` (vLLM's): logit bias, the min_tokens ban, the repetition
penalty (prompt + outputs), presence and frequency penalties (outputs). Each touches only the rows that need
it, with per-row values travelling as [R, 1] tensors. Truncation (temperature, top-k/p, min-p) is not a
processor: it belongs to the draw (``sample/truncation.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Sequence

import numpy as np
import torch

from kvserve.device_copy import to_device
from kvserve.sample.metadata import SamplingRow


class LogitsProcessor(ABC):
    """One transform of the logits, with optional per-request state whose lifecycle the ``Sampler`` drives.

    State is keyed by ``SamplingRow.generator_key`` (the engine-side id of one sample). A stateful processor
    sets ``is_stateful`` and overrides the hooks below; the sampler calls them only on stateful processors, so
    a stateless one costs nothing per row and per step beyond ``is_needed`` and ``apply``:

        add(key, row)           once, the first time ``key`` appears in a batch, before ``apply``
        prepare(rows)           before the forward pass whose logits ``rows`` will sample: work that needs
                                no logits may start here and overlap the model (the grammar masks)
        fork(parent, child)     when a sample forks into n, before the child's first row is sampled
        accept(key, token_ids)  after each draw, with the tokens appended to ``key``
        drop(key)               when the request finishes or is aborted
    """

    is_stateful: ClassVar[bool] = False

    @abstractmethod
    def is_needed(self, row: SamplingRow) -> bool:
        """Whether ``apply`` changes this row this step. It must hold for every row whose key has state here:
        the sampler skips all processing when no processor needs any row."""

    def reads_history(self, row: SamplingRow) -> bool:
        """Whether ``apply`` reads the row's tokens (not just its params and ``position``): such a row cannot be
        sampled again before its last token is read back (the overlapped scheduler). By default, whenever the
        processor is needed."""
        return self.is_needed(row)

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """Transform, in place, the rows ``i`` of ``logits`` for which ``is_needed(rows[i])``; leave the
        others bit for bit. Batched over those rows: no Python loop over the vocabulary."""

    def add(self, key: str, row: SamplingRow) -> None:
        """Create the state of a new key from its first row (its params and history so far)."""

    def prepare(self, rows: Sequence[SamplingRow]) -> None:
        """Start what ``apply(logits, rows)`` will need that does not depend on the logits."""

    def fork(self, parent_key: str, child_key: str) -> None:
        """Give ``child_key`` (which holds no state) a copy of ``parent_key``'s state, if it has any; later
        ``accept`` calls on either leave the other unchanged."""

    def accept(self, key: str, token_ids: Sequence[int]) -> None:
        """Advance the state of ``key`` (if any) past the tokens just appended to it."""

    def drop(self, key: str) -> None:
        """Free the state of ``key``; unknown keys are ignored."""

    @property
    def num_states(self) -> int:
        """How many keys hold state here (for tests and leak checks)."""
        return 0


def default_processors(grammar: LogitsProcessor | None = None) -> list[LogitsProcessor]:
    """A fresh set of processors, in the order they run. The bias runs before the min_tokens ban, so no bias
    can lift a banned EOS; the penalties run last, on biased logits, as in vLLM."""
    return [
        # Structured output's grammar mask (sample/grammar.py) first: it only turns disallowed tokens into -inf,
        # which every processor below keeps at -inf, so they all work on the allowed tokens alone.
        *([grammar] if grammar is not None else []),
        LogitBias(),
        MinTokensBan(),
        RepetitionPenalty(),
        PresenceFrequencyPenalties(),
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
        _check_token_ids(token_ids, logits.shape[1], "logit_bias")
        index = (_long(row_ids, logits.device), _long(token_ids, logits.device))
        logits.index_put_(index, to_device(biases, logits.dtype, logits.device), accumulate=True)


class MinTokensBan(LogitsProcessor):
    """Masks EOS (unless ignored) and stop tokens to -inf in rows that draw an output before ``min_tokens``
    (their ``position``: what they ban depends on how many tokens they have, not on which)."""

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
        _check_token_ids(token_ids, logits.shape[1], "eos / stop_token_ids")
        logits[_long(row_ids, logits.device), _long(token_ids, logits.device)] = -float("inf")


class RepetitionPenalty(LogitsProcessor):
    """For tokens seen in the prompt or the outputs: positive logits divided by the penalty, others multiplied."""

    def is_needed(self, row: SamplingRow) -> bool:
        return row.params.repetition_penalty != 1.0

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        selected = _needed_rows(self, rows)
        if not selected:
            return
        index = _long(selected, logits.device)
        sub = logits[index]
        histories = [_full_history(rows[i]) for i in selected]
        seen = token_counts(histories, sub.shape[1], sub.device) > 0
        penalty = _column([rows[i].params.repetition_penalty for i in selected], sub)
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[index] = torch.where(seen, penalized, sub)


class PresenceFrequencyPenalties(LogitsProcessor):
    """Subtracts ``frequency_penalty * count + presence_penalty * (count > 0)`` over output tokens."""

    def is_needed(self, row: SamplingRow) -> bool:
        return row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        selected = _needed_rows(self, rows)
        if not selected:
            return
        index = _long(selected, logits.device)
        sub = logits[index]
        counts = token_counts([rows[i].output_token_ids for i in selected], sub.shape[1], sub.device)
        frequency = _column([rows[i].params.frequency_penalty for i in selected], sub)
        presence = _column([rows[i].params.presence_penalty for i in selected], sub)
        logits[index] = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)


def token_counts(histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float counts of each token in each row's history (lists or integer arrays)."""
    flat = [np.asarray(h, dtype=np.int64) for h in histories]
    lengths = [len(f) for f in flat]
    row_ids = np.repeat(np.arange(len(flat)), lengths)
    counts = torch.zeros(len(flat), vocab_size, device=device)
    if sum(lengths):
        token_ids = np.concatenate(flat)
        _check_token_ids(token_ids, vocab_size, "history")
        index = (to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device))
        counts.index_put_(index, torch.ones(len(token_ids), device=device), accumulate=True)
    return counts


def _banned_token_ids(row: SamplingRow) -> list[int]:
    if row.position >= row.params.min_tokens:
        return []
    eos = () if row.params.ignore_eos else row.eos_token_ids
    return sorted(set(eos).union(row.params.stop_token_ids))


def _full_history(row: SamplingRow) -> np.ndarray:
    return np.concatenate(
        (np.asarray(row.prompt_token_ids, dtype=np.int64), np.asarray(row.output_token_ids, dtype=np.int64))
    )


def _needed_rows(processor: LogitsProcessor, rows: Sequence[SamplingRow]) -> list[int]:
    return [i for i, r in enumerate(rows) if processor.is_needed(r)]


def _check_token_ids(token_ids: Sequence[int] | np.ndarray, vocab_size: int, what: str) -> None:
    ids = np.asarray(token_ids, dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        shown = sorted(set(bad.tolist()))[:8]
        raise ValueError(f"{what}: token ids {shown} are outside the vocabulary [0, {vocab_size})")


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.dtype, like.device)[:, None]
