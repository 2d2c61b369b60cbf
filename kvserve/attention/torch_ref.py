"""Paged attention in plain PyTorch: the CPU product, and the oracle every faster backend is tested against.

Per layer, one gather copies every key and value the step reads out of the paged cache into a reused
workspace, head-major, then one SDPA call runs all decodes and one more runs each prefill chunk::

    gathered rows (one index_select per layer, for K and again for V):
      | decodes [D, kv_heads, num_keys] (padded) | chunk 0 [kv_heads, keys 0] | chunk 1 [kv_heads, keys 1] | ...

A decode's query heads of one KV head are folded into SDPA's query-length axis ([D, kv_heads, group, d]),
so grouped-query attention reads each KV head once without repeating it. Prefill chunks broadcast K/V over
the group with a stride-0 view. Masks and gather indices are built once per step in ``build_metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, AttentionInputs, AttentionMetadata
from kvserve.kv.storage import KVCacheStorage


@dataclass(frozen=True)
class DecodeKeys:
    """The keys of the step's decodes, padded to ``num_keys`` per sequence.

    Decode i reads positions ``start_i .. seq_len_i - 1`` (``start_i`` = 0, or ``seq_len_i - window``
    under a sliding window), left-aligned in the padded row; ``mask`` is False on the padding.
    """

    num_keys: int
    mask: torch.Tensor  # bool [num_decodes, 1, 1, num_keys]


@dataclass(frozen=True)
class PrefillKeys:
    """One prefill chunk: query rows ``query_start .. query_end - 1`` over ``num_keys`` keys, which are
    positions ``seq_len - num_keys .. seq_len - 1`` (a sliding window drops keys no query of the chunk sees)."""

    query_start: int
    query_end: int
    num_keys: int
    mask: torch.Tensor | None  # bool [num_queries, num_keys]; None: plain causal (no context, no window cut)


@dataclass
class WindowPlan:
    """What the layers with one sliding window (None = global) read: the flat slot of every key, per SDPA
    call in gather order (decodes, then each chunk), and each call's masks."""

    slots: list[torch.Tensor]  # int64, one per call: [num_decodes, num_keys] for decodes, [num_keys] per chunk
    decode: DecodeKeys | None
    prefills: list[PrefillKeys]
    _rows_by_kv_heads: dict[int, torch.Tensor] = field(default_factory=dict)

    def gather_rows(self, num_kv_heads: int) -> torch.Tensor:
        """Row ids into a cache viewed as [num_slots * num_kv_heads, head_dim], head-major per call
        (memoised: every layer of the step shares them)."""
        rows = self._rows_by_kv_heads.get(num_kv_heads)
        if rows is None:
            heads = torch.arange(num_kv_heads, device=self.slots[0].device).unsqueeze(-1)
            rows = torch.cat([(s.unsqueeze(-2) * num_kv_heads + heads).flatten() for s in self.slots])
            self._rows_by_kv_heads[num_kv_heads] = rows
        return rows

    @property
    def slot_counts(self) -> list[int]:
        return [s.numel() for s in self.slots]


@dataclass
class TorchRefMetadata(AttentionMetadata):
    """The step's inputs plus one ``WindowPlan`` per distinct sliding window of the model."""

    inputs: AttentionInputs
    plans: dict[int | None, WindowPlan]


class TorchRefBackend(AttentionBackend):
    """Paged attention with ``scaled_dot_product_attention``; works on any device and float dtype.

    Holds a gather workspace that grows to the largest step seen, so layers do not allocate (and page-fault)
    tens of megabytes each; one step runs at a time.
    """

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def build_metadata(self, inputs: AttentionInputs, sliding_windows: set[int | None]) -> TorchRefMetadata:
        """One Python pass over the step's prefill chunks; decodes are handled as one batch."""
        _validate(inputs)
        plans = {w: _window_plan(inputs, w) for w in sliding_windows}
        return TorchRefMetadata(inputs=inputs, plans=plans)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        kv: KVCacheStorage,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if not isinstance(meta, TorchRefMetadata):
            raise TypeError(f"TorchRefBackend needs TorchRefMetadata, got {type(meta).__name__}")
        plan = _plan_for(meta, sliding_window)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if num_tokens != meta.inputs.num_tokens or num_heads % num_kv_heads:
            raise ValueError(
                f"q {tuple(q.shape)} / k {tuple(k.shape)} do not fit a step of {meta.inputs.num_tokens} tokens "
                "with num_heads a multiple of num_kv_heads"
            )
        kv.write(layer, k, v, meta.inputs.slot_mapping)
        keys, values = self._gather(kv, layer, plan.gather_rows(num_kv_heads), q.dtype)
        sizes = [n * num_kv_heads for n in plan.slot_counts]
        keys, values = keys.split(sizes), values.split(sizes)
        out = q.new_empty(q.shape)
        group = num_heads // num_kv_heads
        call = 0
        if plan.decode is not None:
            _decode_attention(q, keys[0], values[0], plan.decode, out, scale, group)
            call = 1
        for chunk, ck, cv in zip(plan.prefills, keys[call:], values[call:]):
            _prefill_attention(q, ck, cv, chunk, out, scale, group)
        return out

    def _gather(
        self, kv: KVCacheStorage, layer: int, rows: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step's K and V rows ([num_rows, head_dim]) out of the cache into the workspace."""
        k_cache, v_cache = kv.k_caches[layer], kv.v_caches[layer]
        head_dim, num_rows = k_cache.shape[-1], rows.numel()
        buffer = self._buffer(2 * num_rows * head_dim, k_cache.dtype, k_cache.device)
        keys = buffer[: num_rows * head_dim].view(num_rows, head_dim)
        values = buffer[num_rows * head_dim :].view(num_rows, head_dim)
        torch.index_select(k_cache.view(-1, head_dim), 0, rows, out=keys)
        torch.index_select(v_cache.view(-1, head_dim), 0, rows, out=values)
        return keys.to(dtype), values.to(dtype)

    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.dtype != dtype or ws.device != device or ws.numel() < numel:
            ws = self._workspace = torch.empty(numel, dtype=dtype, device=device)
        return ws[:numel]


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, decode: DecodeKeys, out: torch.Tensor,
    scale: float, group: int,
) -> None:
    """All decodes in one SDPA call; the query heads sharing a KV head ride on the query-length axis."""
    num_decodes, head_dim = decode.mask.shape[0], q.shape[-1]
    num_kv_heads = q.shape[1] // group
    shape = (num_decodes, num_kv_heads, decode.num_keys, head_dim)
    queries = q[:num_decodes].view(num_decodes, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(
        queries, keys.view(shape), values.view(shape), attn_mask=decode.mask, scale=scale
    )
    out[:num_decodes] = o.view(num_decodes, -1, head_dim)


def _prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: PrefillKeys, out: torch.Tensor,
    scale: float, group: int,
) -> None:
    """One chunk in one SDPA call over [kv_heads, group, queries, d]; K/V are broadcast over the group."""
    num_queries, head_dim = chunk.query_end - chunk.query_start, q.shape[-1]
    num_kv_heads = q.shape[1] // group
    queries = q[chunk.query_start : chunk.query_end].view(num_queries, num_kv_heads, group, head_dim)
    kv_shape = (num_kv_heads, group, chunk.num_keys, head_dim)
    o = F.scaled_dot_product_attention(
        queries.permute(1, 2, 0, 3),
        keys.view(num_kv_heads, 1, chunk.num_keys, head_dim).expand(kv_shape),
        values.view(num_kv_heads, 1, chunk.num_keys, head_dim).expand(kv_shape),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
    )
    out[chunk.query_start : chunk.query_end].view(num_queries, num_kv_heads, group, head_dim).copy_(
        o.permute(2, 0, 1, 3)
    )


def _validate(inputs: AttentionInputs) -> None:
    query_lens, seq_lens = inputs.query_lens_list, inputs.seq_lens_list
    if len(query_lens) != len(seq_lens) or sum(query_lens) != inputs.num_tokens:
        raise ValueError(
            f"query_lens {query_lens} and seq_lens {seq_lens} disagree with the step's {inputs.num_tokens} tokens"
        )
    if any(n != 1 for n in query_lens[: inputs.num_decodes]):
        raise ValueError(f"the first num_decodes={inputs.num_decodes} sequences must have one query token each")
    if any(not 0 < q <= s for q, s in zip(query_lens, seq_lens)):
        raise ValueError(f"every sequence needs 0 < query_len <= seq_len; got {query_lens} and {seq_lens}")


def _plan_for(meta: TorchRefMetadata, sliding_window: int | None) -> WindowPlan:
    plan = meta.plans.get(sliding_window)
    if plan is None:
        raise ValueError(
            f"sliding_window={sliding_window} was not among the windows given to build_metadata "
            f"({sorted(meta.plans, key=str)})"
        )
    return plan


def _window_plan(inputs: AttentionInputs, window: int | None) -> WindowPlan:
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be a positive number of tokens, got {window}")
    slots, decode = [], None
    if inputs.num_decodes:
        decode_slots, decode = _decode_keys(inputs, window)
        slots.append(decode_slots)
    prefills = []
    query_starts = list(accumulate(inputs.query_lens_list, initial=0))
    for seq in range(inputs.num_decodes, inputs.num_seqs):
        chunk_slots, chunk = _prefill_keys(inputs, seq, query_starts[seq], window)
        slots.append(chunk_slots)
        prefills.append(chunk)
    return WindowPlan(slots=slots, decode=decode, prefills=prefills)


def _decode_keys(inputs: AttentionInputs, window: int | None) -> tuple[torch.Tensor, DecodeKeys]:
    """Padded key positions of every decode, left-aligned::

        decode i:  | start_i ............ seq_len_i - 1 | padding (masked, reads position 0) |
                   |<------------------- num_keys ------------------------------------------>|
    """
    num_decodes = inputs.num_decodes
    seq_lens = inputs.seq_lens[:num_decodes].long()
    max_len = max(inputs.seq_lens_list[:num_decodes])
    num_keys = max_len if window is None else min(window, max_len)
    start = torch.zeros_like(seq_lens) if window is None else (seq_lens - window).clamp_min(0)
    positions = start.unsqueeze(1) + torch.arange(num_keys, device=seq_lens.device)
    valid = positions < seq_lens.unsqueeze(1)
    positions = torch.where(valid, positions, 0)
    slots = _slots(inputs.block_tables[:num_decodes], positions, inputs.block_size)
    return slots, DecodeKeys(num_keys=num_keys, mask=valid[:, None, None, :])


def _prefill_keys(
    inputs: AttentionInputs, seq: int, query_start: int, window: int | None
) -> tuple[torch.Tensor, PrefillKeys]:
    """Key positions and mask of one chunk::

        positions:  0 ... key_start ......... context_len ............ seq_len - 1
                          |<------------- keys ---------------------------------->|
                                              |<------ queries (this chunk) ----->|
    """
    num_queries, seq_len = inputs.query_lens_list[seq], inputs.seq_lens_list[seq]
    context_len = seq_len - num_queries
    key_start = 0 if window is None else max(0, context_len - window + 1)
    device = inputs.block_tables.device
    key_pos = torch.arange(key_start, seq_len, device=device)
    slots = _slots(inputs.block_tables[seq], key_pos, inputs.block_size)
    is_plain_causal = context_len == 0 and (window is None or window >= num_queries)
    mask = None
    if not is_plain_causal:
        query_pos = torch.arange(context_len, seq_len, device=device).unsqueeze(1)
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
    chunk = PrefillKeys(query_start, query_start + num_queries, seq_len - key_start, mask)
    return slots, chunk


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of token positions (``block_table`` is [..., max_blocks], matching positions' batch)."""
    block_ids = block_table.long().gather(-1, positions // block_size)
    return block_ids * block_size + positions % block_size
