"""SamplingBatch: what the sampler needs to know about each row of one step's logits.

A row is one (request, sample index), built by the model runner: a request forking into n samples on its last
prompt step contributes n rows that share a history and differ only in their sample index and key (so in their
seeded generator and in the sampler state kept under the key).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from kvserve.sampling_params import SamplingParams


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

    def __len__(self) -> int:
        return len(self.rows)

    @cached_property
    def is_all_greedy(self) -> bool:
        return all(r.params.is_greedy for r in self.rows)

    @cached_property
    def needs_logprobs(self) -> bool:
        return any(r.params.logprobs is not None for r in self.rows)
