"""Paged attention in plain PyTorch: the oracle every faster backend is tested against.

It also serves CPU models that are not fp32, and stands in where ``cpu_paged`` or ``triton`` cannot run
(``selector.py``).

Per layer, one gather copies every key and value the step reads out of the paged cache into a reused
workspace, head-major, then one SDPA call runs all decodes and one more runs each prefill chunk::

    gathered rows (one index_select per layer, for K and again for V):
      | decodes [D, kv_heads, num_keys] (padded) | chunk 0 [kv_heads, keys 0] | chunk 1 [kv_heads, keys 1] | ...

The query heads that share a KV head ride on SDPA's query-length axis for decodes ([D, kv_heads, group, d]),
and K/V are broadcast over the group with a stride-0 view for chunks, so grouped-query attention never
materialises repeated KV heads. Slots and masks are built once per step in ``build_metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Collection

import torch
import torch.nn.functional as F

from kvserve.attention.backend import (
    AttentionBackend, AttentionInputs, AttentionMetadata, Rope, check_window_sizes,
)
from kvserve.kv.storage import KVCacheStorage, KVLayerView

MIN_DECODE_GROUP = 8
MAX_DECODE_GROUPS_CPU = 4


@dataclass(frozen=True)
class DecodeBatch:
    """A group of decodes of similar length, as one SDPA call over keys padded to ``num_keys`` per sequence::

        decode i:  | start_i ............ seq_len_i - 1 | padding (masked, reads position 0) |
                   |<------------------------------ num_keys ------------------------------->|

    ``start_i`` is 0, or ``seq_len_i - window`` under a sliding window. ``rows`` are the group's query rows.
    """

    rows: torch.Tensor  # int64 [n]: the step's query rows of this group's decodes
    slots: torch.Tensor  # int64 [n, num_keys]: flat cache slot of each key
    mask: torch.Tensor  # bool [n, 1, 1, num_keys]: False on the padding

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor, scale: float
    ) -> None:
        """q, out: the step's [T, heads, d]; keys, values: this call's gathered rows [n * kv_heads * keys, d]."""
        num_decodes, num_keys = self.slots.shape
        head_dim = q.shape[-1]
        kv_shape = (num_decodes, -1, num_keys, head_dim)
        keys, values = keys.view(kv_shape), values.view(kv_shape)
        queries = q.index_select(0, self.rows).unflatten(1, (keys.shape[1], -1))  # [n, kv_heads, group, d]
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask, scale=scale)
        out.index_copy_(0, self.rows, o.reshape(num_decodes, *out.shape[1:]))


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill chunk, as one SDPA call: query rows ``query_start .. query_end - 1`` over the keys at
    positions ``key_start .. seq_len - 1``::

        positions:  0 ... key_start ......... context_len ............ seq_len - 1
                          |<------------- keys ---------------------------------->|
                                              |<------ queries (this chunk) ----->|

    ``key_start`` is 0 unless a sliding window hides the oldest keys from every query of the chunk.
    """

    slots: torch.Tensor  # int64 [num_keys]
    query_start: int
    query_end: int
    mask: torch.Tensor | None  # bool [num_queries, num_keys]; None: plain causal (no context, no window cut)

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor, scale: float
    ) -> None:
        """Runs over [kv_heads, group, queries, d]; K/V ([kv_heads * keys, d]) are broadcast over the group."""
        num_keys, head_dim = self.slots.shape[0], q.shape[-1]
        keys, values = keys.view(-1, 1, num_keys, head_dim), values.view(-1, 1, num_keys, head_dim)
        queries = q[self.query_start : self.query_end].unflatten(1, (keys.shape[0], -1))  # [Lq, kv_heads, group, d]
        kv_shape = (*queries.shape[1:3], num_keys, head_dim)
        o = F.scaled_dot_product_attention(
            queries.permute(1, 2, 0, 3), keys.expand(kv_shape), values.expand(kv_shape),
            attn_mask=self.mask, is_causal=self.mask is None, scale=scale,
        )
        out[self.query_start : self.query_end].view(queries.shape).copy_(o.permute(2, 0, 1, 3))


@dataclass
class WindowPlan:
    """The SDPA calls of every layer with one sliding window (None = global), in gather order."""

    calls: list[DecodeBatch | PrefillChunk]
    _rows_by_kv_heads: dict[int, torch.Tensor] = field(default_factory=dict)

    def gather_rows(self, num_kv_heads: int) -> torch.Tensor:
        """Row ids into a cache viewed as [num_slots * num_kv_heads, head_dim], head-major per call
        (memoised: every layer of the step shares them)."""
        rows = self._rows_by_kv_heads.get(num_kv_heads)
        if rows is None:
            heads = torch.arange(num_kv_heads, device=self.calls[0].slots.device).unsqueeze(-1)
            rows = torch.cat([(c.slots.unsqueeze(-2) * num_kv_heads + heads).flatten() for c in self.calls])
            self._rows_by_kv_heads[num_kv_heads] = rows
        return rows


@dataclass
class TorchRefMetadata(AttentionMetadata):
    """The step's inputs plus one ``WindowPlan`` per distinct sliding window of the model."""

    inputs: AttentionInputs
    plans: dict[int | None, WindowPlan]

    @property
    def sliding_windows(self) -> Collection[int | None]:
        """The windows planned for: the plans' keys (the dict itself, so that reading them allocates nothing)."""
        return self.plans


class TorchRefBackend(AttentionBackend):
    """Paged attention with ``scaled_dot_product_attention``; works on any device and float dtype.

    Holds a gather workspace that grows to the largest step seen, so layers neither allocate nor page-fault
    tens of megabytes each (measured: 2x on fp32 CPU decodes); one step runs at a time.
    """

    metadata_type = TorchRefMetadata

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def build_metadata(self, inputs: AttentionInputs, sliding_windows: set[int | None]) -> TorchRefMetadata:
        """One Python pass over the step's prefill chunks per window; the decodes are one batch."""
        inputs.validate()
        check_window_sizes(sliding_windows)
        # Grouping decodes by length pays where a step is bound by the bytes of K/V it reads (CPU); on CUDA
        # this path is bound by kernel launches, and each group adds a gather, an SDPA and a scatter per layer
        # (measured on an H100: 256 decodes in length groups of 8 made the step 2.2x slower).
        max_groups = 1 if inputs.seq_lens.device.type == "cuda" else MAX_DECODE_GROUPS_CPU
        plans = {w: _window_plan(inputs, w, max_groups) for w in sliding_windows}
        return TorchRefMetadata(inputs=inputs, plans=plans)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, kv: KVCacheStorage,
        meta: TorchRefMetadata, scale: float, sliding_window: int | None, rope: Rope | None,
    ) -> torch.Tensor:
        plan, num_kv_heads = meta.plans[sliding_window], k.shape[1]
        kv.write(layer, meta.inputs.slot_mapping, k, v)
        keys, values = self._gather(kv.layer(layer), plan.gather_rows(num_kv_heads), q)
        sizes = [c.slots.numel() * num_kv_heads for c in plan.calls]
        out = q.new_empty(q.shape)
        for call, call_keys, call_values in zip(plan.calls, keys.split(sizes), values.split(sizes)):
            call.attend(q, call_keys, call_values, out, scale)
        return out

    def _gather(
        self, layer_kv: KVLayerView, rows: torch.Tensor, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step's K and V rows ([num_rows, head_dim], q's dtype) out of the cache into the workspace."""
        head_dim, num_rows = q.shape[-1], rows.numel()
        buffer = self._buffer(2 * num_rows * head_dim, q.dtype, q.device).view(2, num_rows, head_dim)
        keys, values = layer_kv.gather_rows(rows, buffer)
        return keys, values

    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.dtype != dtype or ws.device != device or ws.numel() < numel:
            ws = self._workspace = torch.empty(numel, dtype=dtype, device=device)
        return ws[:numel]


def _window_plan(inputs: AttentionInputs, window: int | None, max_decode_groups: int) -> WindowPlan:
    calls: list[DecodeBatch | PrefillChunk] = [
        _decode_batch(inputs, rows, window)
        for rows in _decode_groups(inputs.seq_lens_list[: inputs.num_decodes], max_decode_groups)
    ]
    query_starts = list(accumulate(inputs.query_lens_list, initial=0))
    for seq in range(inputs.num_decodes, inputs.num_seqs):
        calls.append(_prefill_chunk(inputs, seq, query_starts[seq], window))
    return WindowPlan(calls)


def _decode_groups(seq_lens: list[int], max_groups: int) -> list[list[int]]:
    """Decodes grouped by length so that padding to a group's longest costs at most a quarter more keys
    than the group holds (contexts in a batch can differ tenfold; one padded call would read them all at
    the longest). Groups have at least ``MIN_DECODE_GROUP`` members and there are at most ``max_groups``,
    so the number of SDPA calls stays small."""
    min_size = max(MIN_DECODE_GROUP, -(-len(seq_lens) // max_groups))
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    total = 0
    for i in order:
        group = groups[-1] if groups else None
        if group is not None and (
            len(group) < min_size or seq_lens[i] * (len(group) + 1) <= 1.25 * (total + seq_lens[i])
        ):
            group.append(i)
            total += seq_lens[i]
        else:
            groups.append([i])
            total = seq_lens[i]
    return groups


def _decode_batch(inputs: AttentionInputs, rows: list[int], window: int | None) -> DecodeBatch:
    device = inputs.seq_lens.device
    row_ids = torch.tensor(rows, dtype=torch.long, device=device)
    seq_lens = inputs.seq_lens.long().index_select(0, row_ids)
    max_len = max(inputs.seq_lens_list[r] for r in rows)
    num_keys = max_len if window is None else min(window, max_len)
    start = torch.zeros_like(seq_lens) if window is None else (seq_lens - window).clamp_min(0)
    positions = start.unsqueeze(1) + torch.arange(num_keys, device=device)
    valid = positions < seq_lens.unsqueeze(1)
    block_tables = inputs.block_tables.index_select(0, row_ids)
    slots = _slots(block_tables, torch.where(valid, positions, 0), inputs.block_size)
    return DecodeBatch(rows=row_ids, slots=slots, mask=valid[:, None, None, :])


def _prefill_chunk(inputs: AttentionInputs, seq: int, query_start: int, window: int | None) -> PrefillChunk:
    num_queries, seq_len = inputs.query_lens_list[seq], inputs.seq_lens_list[seq]
    context_len = seq_len - num_queries
    key_start = 0 if window is None else max(0, context_len - window + 1)
    device = inputs.block_tables.device
    key_pos = torch.arange(key_start, seq_len, device=device)
    mask = None
    if context_len > 0 or (window is not None and window < num_queries):
        query_pos = torch.arange(context_len, seq_len, device=device).unsqueeze(1)
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
    slots = _slots(inputs.block_tables[seq], key_pos, inputs.block_size)
    return PrefillChunk(slots=slots, query_start=query_start, query_end=query_start + num_queries, mask=mask)


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of token positions (``block_table`` is [..., max_blocks], matching positions' batch)."""
    block_ids = block_table.long().gather(-1, positions // block_size)
    return block_ids * block_size + positions % block_size
