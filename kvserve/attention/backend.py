"""The attention backend seam: the model calls ``forward`` per layer; the runner builds metadata once a step.

Token layout of a step (decodes first, then prefill chunks; the runner guarantees this order)::

    q rows:   | d0 | d1 | ... | d{D-1} |  p0 chunk  |   p1 chunk   | ...
    seq i:    query_start_loc[i] .. query_start_loc[i+1]   (query_lens[i] tokens)
    kv of i:  positions 0 .. seq_lens[i]-1, stored in blocks block_tables[i, :], slot_mapping gives the
              flat slot (block_id * block_size + offset) of every new token of the step
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Collection

import torch

from kvserve.kv.storage import KVCacheStorage


@dataclass(frozen=True)
class AttentionInputs:
    """Backend-independent description of a step's attention, built by the runner.

    Tensors live on the model's device; the ``*_list`` twins are host copies for Python-side loops.
    """

    num_decodes: int  # the first num_decodes sequences have exactly one query token
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]: KV length after this step (context + new tokens)
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [T]
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionMetadata:
    """Whatever a backend precomputes once per step from ``AttentionInputs`` (masks, gather indices)."""

    inputs: AttentionInputs


class AttentionBackend(ABC):
    """Paged attention over a step's mixed batch of decodes and prefill chunks."""

    # True where the metadata of a decode-only step reads nothing but the input tensors (no host lists), so
    # that metadata built once over static tensors serves every later step of that size once they are refilled
    # (kvserve/worker/cpu_graph.py); the kernels must then read every per-step value from those tensors.
    static_metadata: bool = False

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs, sliding_windows: set[int | None]) -> AttentionMetadata:
        """Precompute what every layer of this step reuses; ``sliding_windows`` lists the distinct windows
        (None = global) the model's layers use."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        layer: int,
        kv: KVCacheStorage,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write k and v of the step's tokens into layer ``layer``'s cache, then return causal attention of
        each query over its sequence's cached keys: [T, num_heads, head_dim]. With ``sliding_window`` w, a
        query at position p sees keys at positions p - w + 1 .. p (HF's convention)."""


def check_sliding_window(sliding_window: int | None, windows: Collection[int | None]) -> None:
    """ValueError unless ``sliding_window`` is one of the windows the step's metadata was built for."""
    if sliding_window not in windows:
        raise ValueError(f"sliding_window={sliding_window} was not among the windows given to build_metadata "
                         f"({sorted(windows, key=str)})")
