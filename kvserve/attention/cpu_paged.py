"""Paged attention for fp32 on CPU that reads keys and values in place from the blocks, through two C kernels.

The reference backend copies every key and value a step reads into a workspace before SDPA reads them again.
Here the step's new K/V are written once through ``KVCacheStorage.write`` and both kernels read the blocks
where they lie (OpenMP on torch's thread count, online softmax). Decodes and prefill chunks go to different
kernels because they are bound by different things:

- decodes (``csrc/paged_decode.c``) are bound by bytes (32 decodes x 440 keys is ~20 MB of fp32 K/V per
  layer), so each streams its blocks once, the query heads of a KV head sharing each key row; decodes whose
  block tables start with the same blocks (prefix-cache hits, samples of one prompt) read those shared keys
  once for all their queries and go on alone from that softmax state;
- prefill chunks (``csrc/paged_prefill.c``) are bound by FLOPs: a work item is a tile of query positions x a
  KV head's query heads, so each key and value row loaded serves a few dozen query rows from registers
  (running each chunk query through the decode kernel instead was 1.2-1.7x slower than SDPA; the tiled
  kernel is 1.4-1.9x faster than SDPA over gathered K/V, up to 4x under a sliding window)::

    q rows:  | d0 | d1 | ... | d{D-1} |  chunk 0  |  chunk 1  | ...
             |<-- paged_decode ----->|<---- paged_prefill --->|

Both kernels read a quantized cache (int8, fp8, int4: ``kvserve/kv/quant.py``) as it is stored, codes and
per-group parameters (int8 in registers, the others a tile of rows at a time into fp32 on the stack); queries
and outputs stay fp32. int4 keys are stored rotated, so the kernels rotate the queries alike as they start
(``kv/csrc/int4_groups.h``'s butterflies: at a one-stream decode step, torch's matrix multiply took 10-17 us a
layer for what the butterflies do in well under one).

``TorchRefBackend`` is the twin the tests compare both against (it dequantizes what it gathers). One difference
is kept on purpose: a NaN score (a NaN key) weighs 0 in the kernels' softmax, where the twin's row turns NaN, since
checking for it would cost the hot loop a compare a lane for a model that is broken already. The kernels are
built at first use (``kvserve.native``) and called through ctypes with raw pointers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvserve.attention.backend import (
    AttentionBackend, AttentionInputs, AttentionMetadata, Rope, check_window_sizes,
)
from kvserve.kv.quant import C_ENCODING_CODES
from kvserve.kv.storage import KVCacheStorage, KVLayerView
from kvserve.native import KernelFunction, kernel_range, load_library

DECODE_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
PREFILL_SOURCE = Path(__file__).parent / "csrc" / "paged_prefill.c"
DECODE_KERNEL_RANGE = "kvserve::paged_decode"  # the kernels' names in torch.profiler traces (a ctypes call is no op)
PREFILL_KERNEL_RANGE = "kvserve::paged_prefill"
_COMMON_ARG_TYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]  # out, its row stride, q, its row stride
    + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64]  # k/v caches, k/v params, encoding, num_blocks
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # block tables + stride, seq lens
)
_DECODE_ARG_TYPES = _COMMON_ARG_TYPES + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]  # num_seqs .. window,
# scale, num_threads
_PREFILL_ARG_TYPES = (
    _COMMON_ARG_TYPES + [ctypes.c_void_p] * 2  # query starts, query lens
    + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int]  # num_chunks .. window, queries_per_tile, scale, threads
)


@dataclass(frozen=True)
class CpuPagedMetadata(AttentionMetadata):
    """The step's inputs and the kernels' arguments: decodes (the first ``num_decodes`` sequences) and chunks."""

    inputs: AttentionInputs
    sliding_windows: frozenset[int | None]
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks], contiguous
    decode_seq_lens: torch.Tensor  # int32 [num_decodes], contiguous
    chunk_block_tables: torch.Tensor  # int32 [num_chunks, max_blocks], contiguous
    chunk_seq_lens: torch.Tensor  # int32 [num_chunks]: cached context + the chunk
    chunk_query_starts: torch.Tensor  # int32 [num_chunks]: the step's row of each chunk's first query
    chunk_query_lens: torch.Tensor  # int32 [num_chunks]

    @property
    def num_chunks(self) -> int:
        return self.inputs.num_seqs - self.inputs.num_decodes


class CpuPagedBackend(AttentionBackend):
    """Decodes and prefill chunks through the in-place C kernels; fp32 models on CPU, any KV encoding.

    Construction builds (or loads the cached) kernels and raises ``KernelBuildError`` when it cannot;
    ``libraries`` (decode, prefill) are builds of the two sources to use instead of this process's (tests pass
    the AVX2 builds on an AVX-512 CPU).
    """

    graph_devices = frozenset({"cpu"})  # decodes' tables and lengths are read from the input tensors by the kernel
    metadata_type = CpuPagedMetadata

    def __init__(self, libraries: tuple[ctypes.CDLL, ctypes.CDLL] | None = None) -> None:
        decode_library, prefill_library = libraries or (None, None)
        self._decode = decode_kernel(decode_library)
        self._prefill, self._queries_per_tile = prefill_kernel(prefill_library)

    def build_metadata(self, inputs: AttentionInputs, sliding_windows: set[int | None]) -> CpuPagedMetadata:
        inputs.validate()
        if inputs.seq_lens.device.type != "cpu":
            raise ValueError(f"CpuPagedBackend runs on CPU; the step's tensors are on {inputs.seq_lens.device}")
        check_window_sizes(sliding_windows)
        _check_table_width(inputs)
        num_decodes = inputs.num_decodes
        tables = inputs.block_tables.to(torch.int32)
        seq_lens = inputs.seq_lens.to(torch.int32)
        return CpuPagedMetadata(
            inputs=inputs,
            sliding_windows=frozenset(sliding_windows),
            decode_block_tables=tables[:num_decodes].contiguous(),
            decode_seq_lens=seq_lens[:num_decodes].contiguous(),
            chunk_block_tables=tables[num_decodes:].contiguous(),
            chunk_seq_lens=seq_lens[num_decodes:].contiguous(),
            chunk_query_starts=inputs.query_start_loc[num_decodes:-1].to(torch.int32).contiguous(),
            chunk_query_lens=torch.tensor(inputs.query_lens_list[num_decodes:], dtype=torch.int32),
        )

    def _check_dtypes(self, q: torch.Tensor, kv: KVCacheStorage, layer: int) -> None:
        layer_kv = kv.layer(layer)
        if (q.dtype != torch.float32 or kv.spec.dtype != torch.float32 or layer_kv.encoding.name not in C_ENCODING_CODES
                or not all(t.is_contiguous() for t in layer_kv.tensors())):
            raise TypeError(f"CpuPagedBackend needs fp32 queries and contiguous caches of fp32 models, stored as "
                            f"{', '.join(C_ENCODING_CODES)}; got {q.dtype} and a {kv.spec.kv_dtype.name} cache")

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, kv: KVCacheStorage,
        meta: CpuPagedMetadata, scale: float, sliding_window: int | None, rope: Rope | None,
    ) -> torch.Tensor:
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # the kernels walk heads head_dim apart within a row
            q = q.contiguous()
        kv.write(layer, meta.inputs.slot_mapping, k, v)  # the chunks' keys are read back in place
        out = torch.empty(q.shape, dtype=q.dtype)
        if meta.inputs.num_decodes:
            self._attend_decodes(q, out, kv.layer(layer), kv, meta, scale, sliding_window)
        if meta.num_chunks:
            self._attend_chunks(q, out, kv.layer(layer), kv, meta, scale, sliding_window)
        return out

    def _attend_decodes(
        self, q: torch.Tensor, out: torch.Tensor, layer_kv: KVLayerView, kv: KVCacheStorage, meta: CpuPagedMetadata,
        scale: float, sliding_window: int | None,
    ) -> None:
        num_heads, head_dim = q.shape[1:]
        tables, num_kv_heads = meta.decode_block_tables, kv.spec.num_kv_heads
        with kernel_range(DECODE_KERNEL_RANGE):
            num_bad = self._decode(
                out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0),
                *_cache_args(layer_kv), kv.num_blocks,
                tables.data_ptr(), tables.stride(0), meta.decode_seq_lens.data_ptr(), meta.inputs.num_decodes,
                num_kv_heads, num_heads // num_kv_heads, head_dim, meta.inputs.block_size, sliding_window or 0, scale,
                torch.get_num_threads(),
            )
        _raise_on_failure(num_bad, "decode", kv)

    def _attend_chunks(
        self, q: torch.Tensor, out: torch.Tensor, layer_kv: KVLayerView, kv: KVCacheStorage, meta: CpuPagedMetadata,
        scale: float, sliding_window: int | None,
    ) -> None:
        num_heads, head_dim = q.shape[1:]
        num_kv_heads = kv.spec.num_kv_heads
        group = num_heads // num_kv_heads
        tables = meta.chunk_block_tables
        with kernel_range(PREFILL_KERNEL_RANGE):
            num_bad = self._prefill(
                out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0),
                *_cache_args(layer_kv), kv.num_blocks,
                tables.data_ptr(), tables.stride(0), meta.chunk_seq_lens.data_ptr(),
                meta.chunk_query_starts.data_ptr(), meta.chunk_query_lens.data_ptr(), meta.num_chunks,
                num_kv_heads, group, head_dim, meta.inputs.block_size, sliding_window or 0,
                self._queries_per_tile(group, _tile_lanes(head_dim)), scale, torch.get_num_threads(),
            )
        _raise_on_failure(num_bad, "prefill", kv)


def _cache_args(layer_kv: KVLayerView) -> tuple[int | None, ...]:
    """The kernels' k/v cache, k/v params (None: unquantized) and encoding arguments."""
    params = [p.data_ptr() if p is not None else None for p in (layer_kv.k_scale, layer_kv.v_scale)]
    return layer_kv.k.data_ptr(), layer_kv.v.data_ptr(), *params, C_ENCODING_CODES[layer_kv.encoding.name]


def _check_table_width(inputs: AttentionInputs) -> None:
    """The kernels look up every key's block in its sequence's row of the block tables, so a row must cover
    the whole sequence."""
    longest = max(inputs.seq_lens_list)
    if longest > inputs.block_tables.shape[1] * inputs.block_size:
        is_decode = longest == max(inputs.seq_lens_list[: inputs.num_decodes], default=0)
        raise ValueError(f"the block tables ({inputs.block_tables.shape[1]} blocks wide) are too narrow for "
                         f"{'decodes' if is_decode else 'sequences'} of up to {longest} tokens")


def _tile_lanes(head_dim: int) -> int:
    """About how many query rows (positions x a KV head's query heads) a prefill work item takes: enough that
    each key and value row loaded serves many, and items enough for every thread on short chunks. The per-item
    stack holds 2 x lanes x head_dim floats (transposed queries, accumulators); at head_dim 256, 16, 32 and 64
    lanes measured alike, so the smaller wins."""
    return 32 if head_dim <= 128 else 16


def _raise_on_failure(num_bad: int, kernel: str, kv: KVCacheStorage) -> None:
    if num_bad < 0:
        raise MemoryError(f"the {kernel} kernel could not allocate its plan")
    if num_bad:
        raise ValueError(f"a {kernel}'s block table names a block outside the cache's {kv.num_blocks} blocks")



# --- the kernel ---------------------------------------------------------------------------------------------------


def decode_kernel(library: ctypes.CDLL | None = None) -> KernelFunction:
    """The compiled ``kvserve_paged_decode_f32`` (of ``library``, default this process's build); raises
    ``KernelBuildError`` (every time) if it cannot be had."""
    library = library or load_library(DECODE_SOURCE)
    return KernelFunction(library.kvserve_paged_decode_f32, _DECODE_ARG_TYPES, ctypes.c_int)


def prefill_kernel(library: ctypes.CDLL | None = None) -> tuple[KernelFunction, Callable[[int, int], int]]:
    """The compiled ``kvserve_paged_prefill_f32`` and its ``queries_per_tile(group, target_lanes)`` (of
    ``library``, default this process's build); raises ``KernelBuildError`` (every time) if they cannot be had."""
    library = library or load_library(PREFILL_SOURCE)
    function = KernelFunction(library.kvserve_paged_prefill_f32, _PREFILL_ARG_TYPES, ctypes.c_int)
    queries_per_tile = library.kvserve_paged_prefill_queries_per_tile
    queries_per_tile.argtypes = [ctypes.c_int, ctypes.c_int]
    queries_per_tile.restype = ctypes.c_int
    return function, queries_per_tile
