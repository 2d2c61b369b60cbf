"""SamplingBatch: what the sampler needs to know about each row of one step's logits.

A row is one (request, sample index) at one output position, built by the model runner: a request forking
into n samples on its last prompt step contributes n rows that share a history and differ only in their
sample index and key (so in their seeded draws and in the sampler state kept under the key). A speculating
request contributes one row per verified position, consecutive: row j's history is its outputs followed by
its first j draft tokens, as if they had been sampled, so that every logits processor sees at each position
the history plain decoding would have shown it::

    draft  d1 d2 d3      rows:  outputs | outputs d1 | outputs d1 d2 | outputs d1 d2 d3
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Sequence

from kvserve.sampling_params import SamplingParams
from kvserve.token_ids import TokenIds


@dataclass(frozen=True)
class SamplingRow:
    """One row: its params, its history (for penalties and min_tokens: a list, or a view of one) and its key.
    ``position`` is the output position the row draws (a seeded row's noise depends on it): its number of
    outputs, and the ``num_in_flight`` sampled by a step still running when this one was launched (the
    overlapped scheduler), which its history does not hold yet."""

    params: SamplingParams
    sample_index: int
    generator_key: str  # the engine-side id of this sample: its sampler state lives under it across steps
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()
    num_in_flight: int = 0

    @property
    def position(self) -> int:
        return len(self.output_token_ids) + self.num_in_flight

    def after(self, token_ids: Sequence[int]) -> SamplingRow:
        """This row ``len(token_ids)`` positions later, ``token_ids`` taken as its next outputs: a view of its
        outputs as they are now (a copy of them for each draft position cost 1.2 ms a speculating request's step
        at 16k outputs)."""
        if not token_ids:
            return self
        return replace(self, output_token_ids=TokenIds(self.output_token_ids, list(token_ids)))


@dataclass(frozen=True)
class SamplingBatch:
    """The rows of one step, in logits order, with the batch-wide facts the sampler branches on.
    ``draft_token_ids`` has one entry per request, its draft (``()`` if it does not speculate), and the
    request reads ``1 + len(draft)`` rows; None when no request speculates: a row per request."""

    rows: list[SamplingRow]
    draft_token_ids: Sequence[tuple[int, ...]] | None = None

    @classmethod
    def of_requests(cls, rows: Sequence[SamplingRow], draft_token_ids: Sequence[tuple[int, ...]]) -> SamplingBatch:
        """The batch of requests whose rows (as plain decoding would sample them) are ``rows``: each
        speculating request's row followed by one row per draft token."""
        if not any(draft_token_ids):
            return cls(list(rows))
        expanded = [r.after(draft[:j]) for r, draft in zip(rows, draft_token_ids) for j in range(len(draft) + 1)]
        return cls(expanded, draft_token_ids)

    def __len__(self) -> int:
        return len(self.rows)

    @cached_property
    def first_rows(self) -> list[int]:
        """Each request's first row (its only one unless it speculates)."""
        if self.draft_token_ids is None:
            return list(range(len(self.rows)))
        starts, row = [], 0
        for draft in self.draft_token_ids:
            starts.append(row)
            row += 1 + len(draft)
        if row != len(self.rows):
            raise ValueError(f"{len(self.rows)} sampling rows for requests that read {row}")
        return starts

    @cached_property
    def is_all_greedy(self) -> bool:
        return all(r.params.is_greedy for r in self.rows)

    @cached_property
    def logprob_rows(self) -> list[int]:
        """The rows that want logprob entries."""
        return [i for i, r in enumerate(self.rows) if r.params.logprobs is not None]

    @cached_property
    def needs_logprobs(self) -> bool:
        return bool(self.logprob_rows)
