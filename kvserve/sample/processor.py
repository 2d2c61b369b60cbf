"""The logits processor interface: one transform of a step's fp32 logits, applied in place by the sampler, with
optional per-sample state whose lifecycle the ``Sampler`` drives (``sample/logits_processors.py`` has the
processors and their order)."""

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
        accept_launched(rows, token_ids)
                                right after a draw without speculation, with its tokens still on the device
                                (one per row): state kept on the device may take them before they are read
        accept(key, token_ids)  after each draw is read back, with the tokens appended to ``key``
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

    def accept_launched(self, rows: Sequence[SamplingRow], token_ids: torch.Tensor) -> None:
        """The tokens just drawn for ``rows`` (int64 [len(rows)], on the device, not read back yet)."""

    def accept(self, key: str, token_ids: Sequence[int]) -> None:
        """Advance the state of ``key`` (if any) past the tokens just appended to it."""

    def drop(self, key: str) -> None:
        """Free the state of ``key``; unknown keys are ignored."""

    @property
    def num_states(self) -> int:
        """How many keys hold state here (for tests and leak checks)."""
        return 0


def token_counts(histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float counts of each token in each row's history (lists or integer arrays)."""
    flat = [np.asarray(h, dtype=np.int64) for h in histories]
    lengths = [len(f) for f in flat]
    row_ids = np.repeat(np.arange(len(flat)), lengths)
    counts = torch.zeros(len(flat), vocab_size, device=device)
    if sum(lengths):
        token_ids = np.concatenate(flat)
        check_token_ids(token_ids, vocab_size, "history")
        index = (to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device))
        counts.index_put_(index, torch.ones(len(token_ids), device=device), accumulate=True)
    return counts


def check_token_ids(token_ids: Sequence[int] | np.ndarray, vocab_size: int, what: str) -> None:
    ids = np.asarray(token_ids, dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        shown = sorted(set(bad.tolist()))[:8]
        raise ValueError(f"{what}: token ids {shown} are outside the vocabulary [0, {vocab_size})")


def ban_where_something_is_left(logits: torch.Tensor, row_ids: Sequence[int], token_ids: Sequence[int]) -> None:
    """``logits[row_ids[i], token_ids[i]]`` to -inf, except in a row the bans would leave with no token to draw
    (another restriction took the rest: a grammar, ``allowed_token_ids``), which keeps its banned tokens: a row of
    -inf drew token 0, outside every restriction. No host sync."""
    index = (to_device(row_ids, torch.long, logits.device), to_device(token_ids, torch.long, logits.device))
    kept = logits[index]
    logits[index] = -float("inf")
    rows = sorted(set(row_ids))  # each banned row read once, whatever it bans
    alive = torch.isfinite(logits[to_device(rows, torch.long, logits.device)]).any(dim=1)
    where = {row: i for i, row in enumerate(rows)}
    stuck = ~alive[to_device([where[row] for row in row_ids], torch.long, logits.device)]  # per entry
    logits[index] = torch.where(stuck, kept, logits[index])
