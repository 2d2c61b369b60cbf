"""Paged attention in Triton for CUDA: the step's decodes through a flash-decoding kernel, its prefill chunks
through one varlen prefill launch, both reading K/V in place from the blocks (``triton_kernels.py``)::

    q rows:  | d0 | d1 | ... | d{D-1} |  chunk 0  |  chunk 1  | ...
             |<- decode: one launch ->|<-- prefill: one launch ->|

The step's new K/V go into their slots first, so a chunk's own keys are read back from the cache like its
context: an unquantized cache's through ``store_kv_kernel`` (keys and values in one launch, the rotary embedding
of keys and queries in it too: at one stream a step is a chain of short kernels, each costing its launch and a
gap), a quantized one's through ``KVCacheStorage.write`` (which quantizes), the layer rotating first.

Decodes are bound by the bytes of K/V they read. A program takes one decode and one KV head (its query heads
ride together, so each key row is loaded once for the group); when decodes x KV heads are too few to fill the
GPU, the visible keys of each decode are split across ``num_splits`` programs whose normalised partial outputs
and log-sum-exps the last of them to finish merges (flash-decoding, its merge in the same launch).
In a step of ``CASCADE_MIN_DECODES`` or more decodes where some share leading blocks (``shared_prefix_lens``),
``cascade_prefix_kernel`` first attends each sharing group's shared keys once per tile of decodes x query heads
(the decodes taken in ``sharing_order``) into the first partial slots of each decode, and the decode kernel reads
only the keys past them (cascade attention, as the CPU kernel has it). Every prefill chunk of the step goes
through one ``paged_prefill_kernel`` launch, causal and windowed masks per row.

Runs on CUDA; on CPU only under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported),
which is how CI tests it. ``TorchRefBackend`` is the twin the tests compare it with, there and natively with
``-m gpu``; every kernel is also compiled for sm_90 without a GPU (``tests/hopper_compile.py``: the interpreter
accepts code the compiler refuses), and ``benchmarks/triton_attention.py`` times the backend on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from kvserve.attention import triton_kernels as kernels
from kvserve.attention.backend import (
    AttentionBackend, AttentionInputs, AttentionMetadata, Rope, check_window_sizes,
)
from kvserve.kv.quant import KVCacheDtype, rotate_queries
from kvserve.kv.storage import KVCacheStorage, KVLayerView
from kvserve.triton_launch import pdl_options

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUANTIZED_ENCODINGS = ("int8", "fp8", "int4")  # each read as triton_kernels' QUANT says
NO_WINDOW = 1 << 30  # a window longer than any sequence: the kernels mask by position with no branch
MIN_SPLIT_KEYS = 64  # a split reads at least this many keys, or its merge costs more than it saves
# the last split of each (decode, KV head) merges the splits in the decode launch; False: merge_splits_kernel
# merges them in a launch of its own (benchmarks/gpu_decode_step.py --separate-merge measures the two)
MERGE_IN_DECODE = True
MIN_SPLIT_COUNTERS = 4096  # (decode, KV head) counters allocated at least: 512 decodes of 8 KV heads
# cascade attention from this many decodes up (below, the prefix launch costs more than the reads it saves: a
# step whose decodes share nothing still makes it, its programs leaving at once), in tiles of this many query
# rows (decodes x the query heads of a KV head)
CASCADE_MIN_DECODES = 16
CASCADE_ROWS = 64
CASCADE_DECODES_PER_TILE = 16  # a typical tile (4 query heads a KV head), for sizing the splits
BLOCK_N = 64  # keys per tile
PREFILL_ROWS = 64  # query rows (positions x query heads of a KV head) per prefill tile
MIN_DOT_ROWS = 16  # tl.dot's smallest M: decode groups are padded up to it
MIN_DOT_DEPTH = 16  # tl.dot's smallest K for 16-bit operands (8 for fp32): a head of 4 or 8 is padded up to it


def is_interpreted() -> bool:
    """Whether the kernels run through Triton's interpreter (on CPU tensors) rather than compiled for a GPU."""
    return not isinstance(kernels.paged_decode_kernel, triton.runtime.JITFunction)


def can_read(encoding: KVCacheDtype) -> bool:
    """Whether the kernels read a cache stored in ``encoding``."""
    return not encoding.has_scales or encoding.name in QUANTIZED_ENCODINGS


@dataclass(frozen=True)
class TritonPagedMetadata(AttentionMetadata):
    """The step's inputs cut into the decodes (the first ``num_decodes`` sequences) and the prefill chunks."""

    inputs: AttentionInputs
    sliding_windows: frozenset[int | None]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    chunk_query_starts: torch.Tensor  # int32 [num_chunks]: the step's row of each chunk's first query
    chunk_query_lens: torch.Tensor  # int32 [num_chunks]
    max_chunk_len: int
    max_decode_len: int
    # cascade attention: the keys each decode shares with its group (inputs.shared_prefix_lens), attended in
    # this many splits by ``cascade_prefix_kernel`` before the decodes go on alone; 0: off
    cascade_splits: int

    @property
    def num_chunks(self) -> int:
        return self.inputs.num_seqs - self.inputs.num_decodes


class TritonPagedBackend(AttentionBackend):
    """Decodes and prefill chunks through Triton kernels; fp16 / bf16 / fp32 models, caches unquantized or
    int8 / fp8 / int4. ``max_kv_splits`` caps the flash-decoding split (1 turns it off)."""

    # the kernels read every decode's length and table from the tensors; the host lengths only pick the split
    # count, which metadata built for a CUDA graph fixes for the longest sequence the graph serves (under the
    # interpreter the kernels run in numpy, which no CPU step graph records)
    graph_devices = frozenset({"cuda"})
    metadata_type = TritonPagedMetadata

    def __init__(self, max_kv_splits: int = 32) -> None:
        if max_kv_splits < 1:
            raise ValueError(f"max_kv_splits must be >= 1, got {max_kv_splits}")
        self.max_kv_splits = max_kv_splits
        self._counters: dict[torch.device, torch.Tensor] = {}
        self._outgrown: list[torch.Tensor] = []  # every counter buffer made, kept alive

    def build_metadata(self, inputs: AttentionInputs, sliding_windows: set[int | None]) -> TritonPagedMetadata:
        inputs.validate()
        device = inputs.seq_lens.device
        if device.type != "cuda" and not is_interpreted():
            raise ValueError(f"TritonPagedBackend runs on CUDA, or on CPU under TRITON_INTERPRET=1; the step's "
                             f"tensors are on {device}")
        check_window_sizes(sliding_windows)
        num_decodes = inputs.num_decodes
        return TritonPagedMetadata(
            inputs=inputs,
            sliding_windows=frozenset(sliding_windows),
            block_tables=inputs.block_tables.to(torch.int32),
            seq_lens=inputs.seq_lens.to(torch.int32),
            chunk_query_starts=inputs.query_start_loc[num_decodes:-1].to(torch.int32),
            chunk_query_lens=inputs.query_start_loc.diff()[num_decodes:].to(torch.int32),
            max_chunk_len=max(inputs.query_lens_list[num_decodes:], default=0),
            max_decode_len=max(inputs.seq_lens_list[:num_decodes], default=0),
            cascade_splits=self._cascade_splits(inputs, sliding_windows),
        )

    def _cascade_splits(self, inputs: AttentionInputs, sliding_windows: set[int | None]) -> int:
        """Splits of the shared keys for ``cascade_prefix_kernel``, enough to fill the GPU twice over with
        tiles of decodes x KV heads, each split at least ``MIN_SPLIT_KEYS`` keys; 0 where the step has fewer
        than ``CASCADE_MIN_DECODES`` decodes, shares fewer than ``MIN_SPLIT_KEYS`` keys, or has no global
        layer (a windowed layer's decodes attend alone)."""
        shared = inputs.max_shared_prefix_len
        if (inputs.shared_prefix_lens is None or inputs.sharing_order is None or shared < MIN_SPLIT_KEYS
                or inputs.num_decodes < CASCADE_MIN_DECODES or None not in sliding_windows):
            return 0
        by_length = shared // MIN_SPLIT_KEYS
        if inputs.seq_lens.device.type != "cuda":
            return max(1, min(self.max_kv_splits, by_length))
        num_sms = torch.cuda.get_device_properties(inputs.seq_lens.device).multi_processor_count
        tiles = math.ceil(inputs.num_decodes / CASCADE_DECODES_PER_TILE)  # x KV heads, unknown here: a lower bound
        return max(1, min(self.max_kv_splits, by_length, math.ceil(2 * num_sms / tiles)))

    def _check_dtypes(self, q: torch.Tensor, kv: KVCacheStorage, layer: int) -> None:
        if q.dtype not in MODEL_DTYPES or q.dtype != kv.spec.dtype:
            raise TypeError(f"TritonPagedBackend takes fp16 / bf16 / fp32 queries in the cache's {kv.spec.dtype}; "
                            f"got {q.dtype}")
        encoding = kv.layer(layer).encoding
        if not can_read(encoding):
            raise NotImplementedError(f"TritonPagedBackend reads caches stored unquantized or as "
                                      f"{' / '.join(QUANTIZED_ENCODINGS)}, not {encoding.name}; use torch_ref")

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, kv: KVCacheStorage,
        meta: TritonPagedMetadata, scale: float, sliding_window: int | None, rope: Rope | None,
    ) -> torch.Tensor:
        if q.stride(-1) != 1:  # the kernels take row and head strides, so column slices of a packed qkv pass as is
            q = q.contiguous()
        layer_kv, window = kv.layer(layer), sliding_window or NO_WINDOW
        if layer_kv.k_scale is None:
            store_kv(layer_kv, meta.inputs.slot_mapping, k, v, rope, q)
        else:  # rope is None here: takes_rope said no
            kv.write(layer, meta.inputs.slot_mapping, k, v)
            q = rotate_queries(q, layer_kv.encoding)  # int4's keys are stored rotated
        out = torch.empty_like(q)
        if meta.inputs.num_decodes:
            self._attend_decodes(q, out, layer_kv, meta, scale, window)
        if meta.num_chunks:
            _attend_chunks(q, out, layer_kv, meta, scale, window)
        return out

    def takes_rope(self, kv: KVCacheStorage, layer: int) -> bool:
        """An unquantized cache's keys are stored by ``store_kv_kernel``, which rotates them and the queries."""
        return kv.layer(layer).k_scale is None

    def _attend_decodes(self, q: torch.Tensor, out: torch.Tensor, layer_kv: KVLayerView, meta: TritonPagedMetadata,
                        scale: float, window: int) -> None:
        num_decodes, (num_heads, head_dim) = meta.inputs.num_decodes, q.shape[1:]
        num_kv_heads = layer_kv.k.shape[2]
        num_splits = self._num_splits(num_decodes * num_kv_heads, min(meta.max_decode_len, window), q.device)
        prefix_slots = meta.cascade_splits if window == NO_WINDOW else 0
        num_slots = prefix_slots + num_splits
        group = num_heads // num_kv_heads
        block_d = dot_depth(head_dim)
        target, lse, counters = out, out, out  # one split: straight into the step's output (lse is never touched)
        merge_here = num_slots > 1 and MERGE_IN_DECODE
        if num_slots > 1:
            target = torch.empty(num_decodes, num_heads, num_slots, head_dim, dtype=torch.float32, device=q.device)
            lse = torch.empty(num_decodes, num_heads, num_slots, dtype=torch.float32, device=q.device)
        if merge_here:
            counters = self._split_counters(num_decodes * num_kv_heads, q.device)
        shared_lens = meta.inputs.shared_prefix_lens if prefix_slots else meta.seq_lens  # without: never read
        if prefix_slots:
            _attend_shared_prefix(q, target, lse, layer_kv, meta, scale, prefix_slots)
        kernels.paged_decode_kernel[(num_decodes, num_kv_heads, num_splits)](
            target, target.stride(0), target.stride(1), target.stride(2) if num_slots > 1 else 0, lse,
            q, q.stride(0), q.stride(1), *_cache_args(layer_kv),
            meta.block_tables, meta.block_tables.stride(0), meta.seq_lens, scale * math.log2(math.e), window,
            out, out.stride(0), out.stride(1), counters, shared_lens,
            GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=meta.inputs.block_size,
            BLOCK_G=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
            **_quant_args(layer_kv.encoding, head_dim), **_dot_args(q), STORE_LSE=num_slots > 1, MERGE=merge_here,
            PREFIX_SLOTS=prefix_slots, **pdl_options(q.device),
        )
        if num_slots > 1 and not merge_here:
            kernels.merge_splits_kernel[(num_decodes, num_heads)](
                out, out.stride(0), out.stride(1), target, lse, num_slots, shared_lens,
                HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_slots), BLOCK_D=block_d,
                PREFIX_SLOTS=prefix_slots, **pdl_options(q.device),
            )

    def _split_counters(self, size: int, device: torch.device) -> torch.Tensor:
        """At least ``size`` int32 counters on ``device``, zero between launches (the decode kernel's last split
        zeroes its own). Allocated once and grown, and never freed: a captured CUDA graph holds their address."""
        counters = self._counters.get(device)
        if counters is None or counters.numel() < size:
            counters = torch.zeros(max(size, MIN_SPLIT_COUNTERS), dtype=torch.int32, device=device)
            self._counters[device] = counters
            self._outgrown.append(counters)
        return counters

    def _num_splits(self, num_programs: int, max_visible_keys: int, device: torch.device) -> int:
        """Splits per decode: enough programs to fill the GPU's multiprocessors twice over, each split reading
        at least ``MIN_SPLIT_KEYS`` keys (under the interpreter, as many as that allows, so tests split)."""
        by_length = math.ceil(max_visible_keys / MIN_SPLIT_KEYS)
        if device.type != "cuda":
            return max(1, min(self.max_kv_splits, by_length))
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(self.max_kv_splits, by_length, math.ceil(2 * num_sms / num_programs)))


def store_kv(layer_kv: KVLayerView, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             rope: Rope | None = None, q: torch.Tensor | None = None) -> None:
    """The step's new keys and values ([T, num_kv_heads, head_dim], rows strided as the packed qkv leaves
    them) into their slots of an unquantized cache, one launch for both. With ``rope`` the keys are stored
    rotated and ``q`` [T, num_heads, head_dim] (elements contiguous) is rotated in place, in that launch; k
    itself is left as it came (the kernels read the step's keys back from the cache)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if not num_tokens:
        return
    cache_k, cache_v = layer_kv.k, layer_kv.v
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    cos, sin = rope if rope is not None else (k, k)  # without rope: never read
    if rope is not None:
        _check_rope(q, cos, sin, head_dim)
    kernels.store_kv_kernel[(num_tokens,)](
        cache_k, cache_v, k, v, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), num_kv_heads,
        k if q is None else q, 0 if q is None else q.stride(0), 0 if q is None else q.stride(1),
        0 if q is None else q.shape[1], cos, sin, cos.stride(0), HEAD_DIM=head_dim, PAGE_SIZE=cache_k.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        ROPE=rope is not None, BLOCK_QH=triton.next_power_of_2(q.shape[1]) if rope is not None else 1,
        **pdl_options(k.device),
    )


def _check_rope(q: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """ValueError unless q and the rope tables are what ``store_kv_kernel`` rotates."""
    if (q is None or q.stride(2) != 1 or q.shape[0] != cos.shape[0] or cos.shape != sin.shape
            or cos.stride() != sin.stride() or cos.shape[-1] * 2 != head_dim or cos.stride(-1) != 1):
        raise ValueError(f"store_kv rotates q [T, heads, {head_dim}] (elements contiguous) by cos / sin "
                         f"[T, 1, {head_dim // 2}] alike; got q {None if q is None else tuple(q.shape)}, cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)}")


def _attend_shared_prefix(q: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, layer_kv: KVLayerView,
                          meta: TritonPagedMetadata, scale: float, num_splits: int) -> None:
    """Cascade attention's first level: the keys each decode shares with its group, attended by tiles of decodes
    in ``sharing_order``, into the first ``num_splits`` partial slots of each decode (``cascade_prefix_kernel``)."""
    num_decodes, (num_heads, head_dim) = meta.inputs.num_decodes, q.shape[1:]
    num_kv_heads = layer_kv.k.shape[2]
    group = num_heads // num_kv_heads
    decodes_per_tile = max(1, CASCADE_ROWS // group)
    grid = (num_kv_heads, num_splits, math.ceil(num_decodes / decodes_per_tile))
    kernels.cascade_prefix_kernel[grid](
        target, target.stride(0), target.stride(1), target.stride(2), lse, q, q.stride(0), q.stride(1),
        *_cache_args(layer_kv), meta.block_tables, meta.block_tables.stride(0), meta.inputs.shared_prefix_lens,
        meta.inputs.sharing_order, scale * math.log2(math.e), num_decodes, target.shape[2], GROUP=group,
        HEAD_DIM=head_dim, PAGE_SIZE=meta.inputs.block_size, DECODES_PER_TILE=decodes_per_tile,
        BLOCK_M=max(CASCADE_ROWS, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        BLOCK_D=dot_depth(head_dim), **_quant_args(layer_kv.encoding, head_dim), **_dot_args(q),
        **pdl_options(q.device),
    )


def _attend_chunks(q: torch.Tensor, out: torch.Tensor, layer_kv: KVLayerView, meta: TritonPagedMetadata,
                   scale: float, window: int) -> None:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = layer_kv.k.shape[2]
    group = num_heads // num_kv_heads
    block_m = max(PREFILL_ROWS, triton.next_power_of_2(group))
    queries_per_tile = block_m // group
    chunk_rows = slice(meta.inputs.num_decodes, None)
    grid = (meta.num_chunks, num_kv_heads, math.ceil(meta.max_chunk_len / queries_per_tile))
    kernels.paged_prefill_kernel[grid](
        out, out.stride(0), out.stride(1), q, q.stride(0), q.stride(1), *_cache_args(layer_kv),
        meta.block_tables[chunk_rows], meta.block_tables.stride(0), meta.seq_lens[chunk_rows],
        meta.chunk_query_starts, meta.chunk_query_lens, scale * math.log2(math.e), window,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=meta.inputs.block_size, QUERIES_PER_TILE=queries_per_tile,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=dot_depth(head_dim),
        **_quant_args(layer_kv.encoding, head_dim), **_dot_args(q), **pdl_options(q.device),
    )


def dot_depth(head_dim: int) -> int:
    """The head width the attention kernels' dots run at: a power of two, at least ``MIN_DOT_DEPTH`` (masked)."""
    return max(MIN_DOT_DEPTH, triton.next_power_of_2(head_dim))


def _quant_args(encoding: KVCacheDtype, head_dim: int) -> dict[str, int]:
    """The kernels' ``QUANT`` and ``QUANT_GROUP`` (values per group) for a cache stored in ``encoding``."""
    if not encoding.has_scales:
        quant = kernels.UNQUANTIZED.value
    else:
        quant = kernels.INT4.value if encoding.has_zero_point else kernels.SCALED.value
    return {"QUANT": quant, "QUANT_GROUP": encoding.group_size(head_dim)}


def _cache_args(layer_kv: KVLayerView) -> tuple[torch.Tensor | int, ...]:
    """The kernels' k/v cache, k/v scales (the data themselves where unquantized: never read) and strides."""
    k, v = layer_kv.k, layer_kv.v
    k_scale = layer_kv.k_scale if layer_kv.k_scale is not None else k
    v_scale = layer_kv.v_scale if layer_kv.v_scale is not None else v
    return k, v, k_scale, v_scale, k.stride(1), k.stride(2), k_scale.stride(1)


def _dot_args(q: torch.Tensor) -> dict[str, str | bool]:
    """fp32 models get fp32 dots (Triton's default for fp32 is tf32, about 3e-4 off the reference); bf16 dots
    are upcast under the interpreter, which gets them wrong."""
    return {"PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
            "UPCAST_DOTS": q.dtype == torch.bfloat16 and is_interpreted()}

