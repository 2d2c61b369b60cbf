"""The attention backend seam: the model calls ``forward`` per layer; the runner builds metadata once a step.

Token layout of a step (decodes first, then prefill chunks; the runner guarantees this order)::

    q rows:   | d0 | d1 | ... | d{D-1} |  p0 chunk  |   p1 chunk   | ...
    seq i:    query_start_loc[i] .. query_start_loc[i+1]   (query_lens[i] tokens)
    kv of i:  positions 0 .. seq_lens[i]-1, stored in blocks block_tables[i, :], slot_mapping gives the
              flat slot (block_id * block_size + offset) of every new token of the step

With KV cache groups (``kv/groups.py``) each group has its own block tables and slot mapping (``AttentionInputs
.groups``), metadata is built per group, and each layer attends through its group's (``GroupedMetadata``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np
import torch

from kvserve.kv.storage import KVCacheStorage

# a layer's rotary embedding at the step's positions: cos and sin [T, 1, head_dim / 2] (HF's half-split
# convention, ``model/layers/rotary.py``)
Rope = tuple[torch.Tensor, torch.Tensor]


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
    # KV cache groups 1..G-1: the same step, through their own block_tables and slot_mapping (their tables'
    # leading entries may be NULL_BLOCK: blocks before every query's window); () with one group
    groups: tuple[AttentionInputs, ...] = ()
    # decodes whose block tables start with the same block share their leading keys (a prompt's prefix-cache
    # hits, its samples), which a backend may attend once for the group (cascade attention): each decode's
    # shared keys (``shared_prefixes``: int32 [num_decodes] on the device, 0 alone) and the decodes in an order
    # that puts each group's together (int32 [num_decodes]); None: not computed. ``max_shared_prefix_len``
    # bounds the lengths on the host: the largest, or for metadata built once for many steps, what they may hold
    shared_prefix_lens: torch.Tensor | None = None
    sharing_order: torch.Tensor | None = None
    max_shared_prefix_len: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def validate(self) -> None:
        """Raise ValueError unless the step's lengths agree: decodes first, one query token each, and every
        sequence with 0 < query_len <= seq_len."""
        query_lens, seq_lens = self.query_lens_list, self.seq_lens_list
        if not query_lens:
            raise ValueError("a step needs at least one sequence")
        if len(query_lens) != len(seq_lens) or sum(query_lens) != self.num_tokens:
            raise ValueError(
                f"query_lens {query_lens} and seq_lens {seq_lens} disagree with the step's {self.num_tokens} tokens"
            )
        if any(n != 1 for n in query_lens[: self.num_decodes]):
            raise ValueError(f"the first num_decodes={self.num_decodes} sequences must have one query token each")
        if any(not 0 < q <= s for q, s in zip(query_lens, seq_lens)):
            raise ValueError(f"every sequence needs 0 < query_len <= seq_len; got {query_lens} and {seq_lens}")


def shared_prefixes(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """For decodes with block tables ``block_tables`` [D, width] and lengths ``seq_lens`` [D]: the keys each
    shares with the other decodes whose tables start with the same block (their longest common run of leading
    blocks, counting only blocks complete before every member's own key; 0 for a decode alone), and the decodes
    ordered by their first block, so that each group's members are consecutive (int32 arrays [D])."""
    num_decodes = len(block_tables)
    shared = np.zeros(num_decodes, dtype=np.int32)
    order = np.argsort(block_tables[:, 0], kind="stable").astype(np.int32) if num_decodes else shared
    if num_decodes < 2:
        return shared, order
    first = block_tables[order, 0]
    starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1]])
    sizes = np.diff(np.r_[starts, num_decodes])
    if sizes.max() < 2:  # most steps: no group at all
        return shared, order
    # every group at once (a step of many samples of a few prompts has many groups): each member's run of blocks
    # equal to its group's first member's, the group's shortest, within the blocks complete for every member
    group_of = np.repeat(np.arange(len(starts)), sizes)
    limit = np.minimum.reduceat((seq_lens[order] - 1) // block_size, starts)
    width = min(int(limit.max()), block_tables.shape[1])
    if not width:  # no member has a complete block yet
        return shared, order
    same = block_tables[order, :width] == block_tables[order[starts], :width][group_of]
    run = np.where(same.all(axis=1), width, same.argmin(axis=1))
    blocks = np.minimum(np.minimum.reduceat(run, starts), limit) * (sizes > 1)
    shared[order] = block_size * blocks[group_of]
    return shared, order


class AttentionMetadata:
    """Whatever a backend precomputes once per step from ``AttentionInputs`` (masks, gather indices)."""

    inputs: AttentionInputs
    # the windows build_metadata was given (None = global): ``forward`` refuses any other
    sliding_windows: Collection[int | None]

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer ``layer`` attends with: this one, unless the step has KV cache groups."""
        return self


@dataclass(frozen=True)
class GroupedMetadata(AttentionMetadata):
    """A step's metadata with KV cache groups: one per group, each layer's picked by its group (a Python lookup
    per layer, nothing a CPU step graph replays)."""

    inputs: AttentionInputs  # group 0's
    groups: tuple[AttentionMetadata, ...]
    layer_groups: tuple[int, ...]

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.groups[self.layer_groups[layer]]


def build_step_metadata(backend: AttentionBackend, inputs: AttentionInputs, group_windows: Sequence[set[int | None]],
                        layer_groups: tuple[int, ...]) -> AttentionMetadata:
    """The step's metadata: the backend's own with one group; else one per group (``group_windows[g]``, the
    windows of group g's layers), as ``GroupedMetadata``."""
    if not inputs.groups:
        return backend.build_metadata(inputs, group_windows[0])
    metas = tuple(backend.build_metadata(group_inputs, windows)
                  for group_inputs, windows in zip((inputs, *inputs.groups), group_windows, strict=True))
    return GroupedMetadata(inputs, metas, layer_groups)


class AttentionBackend(ABC):
    """Paged attention over a step's mixed batch of decodes and prefill chunks.

    ``forward`` checks what every backend needs of its arguments, then hands them to the backend's ``_attend``;
    a backend adds the dtypes and cache encodings its kernels read in ``_check_dtypes``.
    """

    # The device types whose step graphs (kvserve/worker/step_graphs.py) can replay this backend's decode steps:
    # its metadata of a decode-only step reads nothing but the input tensors (no host lists), so that metadata
    # built once over static tensors serves every later step of that size once they are refilled, and its
    # kernels are what that device's graphs record (C kernels on CPU, CUDA kernels on a GPU).
    graph_devices: frozenset[str] = frozenset()
    # what this backend's build_metadata returns, and so what its forward takes
    metadata_type: type[AttentionMetadata]

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs, sliding_windows: set[int | None]) -> AttentionMetadata:
        """Precompute what every layer of this step reuses; ``sliding_windows`` lists the distinct windows
        (None = global) the model's layers use."""

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
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """Write k and v of the step's tokens into layer ``layer``'s cache, then return causal attention of
        each query over its sequence's cached keys: [T, num_heads, head_dim]. With ``sliding_window`` w, a
        query at position p sees keys at positions p - w + 1 .. p (HF's convention). ``rope``: where
        ``takes_rope`` says so, the layer's cos and sin, q and k arriving unrotated; None: already rotated.

        Raises ValueError for a ``rope`` the backend does not take, a window ``meta`` was not built for, or
        shapes that do not fit the step and the cache; TypeError for another backend's metadata, or dtypes
        and cache encodings the backend does not read."""
        if rope is not None and not self.takes_rope(kv, layer):
            raise ValueError(f"{type(self).__name__} does not rotate q and k for this layer (its takes_rope is "
                             "False): the layer applies the rotary embedding before forward")
        if not isinstance(meta, self.metadata_type):
            raise TypeError(f"{type(self).__name__} needs {self.metadata_type.__name__}, got {type(meta).__name__}")
        check_sliding_window(sliding_window, meta.sliding_windows)
        check_step_inputs(q, k, kv, meta.inputs)
        self._check_dtypes(q, kv, layer)
        return self._attend(q, k, v, layer, kv, meta, scale, sliding_window, rope)

    @abstractmethod
    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, kv: KVCacheStorage,
        meta: AttentionMetadata, scale: float, sliding_window: int | None, rope: Rope | None,
    ) -> torch.Tensor:
        """``forward`` once its arguments are checked: ``meta`` is this backend's ``metadata_type``, and ``rope``
        is None unless ``takes_rope`` said yes for ``layer``."""

    def _check_dtypes(self, q: torch.Tensor, kv: KVCacheStorage, layer: int) -> None:
        """TypeError (or NotImplementedError) unless this backend reads queries of q's dtype and layer
        ``layer``'s cache as it is stored. Default: any."""

    def takes_rope(self, kv: KVCacheStorage, layer: int) -> bool:
        """Whether ``forward`` rotates q and k itself for layer ``layer`` (``rope``), in the launch that stores
        the new keys, where the layer would otherwise launch a rotary kernel of its own. Default: no."""
        return False


def check_window_sizes(sliding_windows: Collection[int | None]) -> None:
    """ValueError unless every window handed to ``build_metadata`` is global (None) or a positive number of tokens."""
    if any(w is not None and w < 1 for w in sliding_windows):
        raise ValueError(f"sliding windows must be positive numbers of tokens, got {sorted(sliding_windows, key=str)}")


def check_sliding_window(sliding_window: int | None, windows: Collection[int | None]) -> None:
    """ValueError unless ``sliding_window`` is one of the windows the step's metadata was built for."""
    if sliding_window not in windows:
        raise ValueError(f"sliding_window={sliding_window} was not among the windows given to build_metadata "
                         f"({sorted(windows, key=str)})")


def check_step_inputs(q: torch.Tensor, k: torch.Tensor, kv: KVCacheStorage, inputs: AttentionInputs) -> None:
    """ValueError unless q [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim] have the step's T tokens
    and the cache's KV heads and head size, with a whole number of query heads per KV head."""
    num_tokens, num_heads, head_dim = q.shape
    spec = kv.spec
    if (num_tokens != inputs.num_tokens or k.shape[1] != spec.num_kv_heads or num_heads % spec.num_kv_heads
            or head_dim != spec.head_dim):
        raise ValueError(
            f"q {tuple(q.shape)} / k {tuple(k.shape)} do not fit a step of {inputs.num_tokens} tokens with "
            f"num_heads a multiple of the cache's num_kv_heads={spec.num_kv_heads} and head_dim={spec.head_dim}"
        )
