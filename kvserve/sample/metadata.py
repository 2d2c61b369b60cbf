"""SamplingBatch: what the sampler needs to know about each row of one step's logits.

A row is one (request, sample index): a request forking into n samples on its last prompt step contributes n
rows that share a history and differ only in their sample index (so in their seeded generator).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from kvserve.request import sample_request_id
from kvserve.sampling_params import SamplingParams
from kvserve.sched.output import ScheduledRequest


@dataclass(frozen=True)
class SamplingRow:
    """One row: its params, its history (for penalties and min_tokens; lists or integer arrays) and its key."""

    params: SamplingParams
    sample_index: int
    generator_key: str  # the engine-side id of this sample: its sampler state lives under it across steps
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class SamplingBatch:
    """The rows of one step, in logits order, with the batch-wide facts the sampler branches on."""

    rows: list[SamplingRow]

    @classmethod
    def from_rows(cls, requests: Sequence[ScheduledRequest], sample_indices: Sequence[int]) -> SamplingBatch:
        """One row per (request, sample index); a forking request appears once per sample, and its rows'
        generators are keyed by the ids its samples will carry from the next step on."""
        if len(requests) != len(sample_indices):
            raise ValueError(f"{len(requests)} sampling requests but {len(sample_indices)} sample indices")
        rows = []
        for req, index in zip(requests, sample_indices):
            key = sample_request_id(req.request_id, index) if req.num_samples > 1 else req.request_id
            rows.append(SamplingRow(
                req.sampling_params, index, key, req.prompt_token_ids, req.output_token_ids, req.eos_token_ids
            ))
        return cls(rows)

    def __len__(self) -> int:
        return len(self.rows)

    @cached_property
    def is_all_greedy(self) -> bool:
        return all(r.params.is_greedy for r in self.rows)

    @cached_property
    def needs_logprobs(self) -> bool:
        return any(r.params.logprobs is not None for r in self.rows)

