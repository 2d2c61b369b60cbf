"""Paged attention for fp32 on CPU that reads decode keys and values in place from the blocks.

The reference backend copies every key and value a step reads into a workspace before SDPA reads them again;
on CPU, decodes are bound by those bytes (32 decodes x 440 keys is ~20 MB of fp32 K/V per layer). Here each
decode streams its own blocks once through a small C kernel (``csrc/paged_decode.c``: OpenMP over sequences
and KV heads, online softmax, the query heads of a KV head sharing each key row; decodes whose block tables
start with the same blocks, prefix-cache hits or samples of one prompt, read those shared keys once for all
their queries and go on alone from that softmax state), while prefill chunks, which
are bound by FLOPs rather than bytes, keep SDPA over a gather of their keys (measured: SDPA beats running
each chunk query through the kernel by 1.2-1.7x); the reference backend runs them as a sub-step of their own::

    q rows:  | d0 | d1 | ... | d{D-1} |  chunk 0  |  chunk 1  | ...
             |<-- decode kernel ---->|<-- TorchRefBackend --->|

The kernel is built at first use (``kvserve.native``) and called through ctypes with raw pointers, on torch's
thread count.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from kvserve.attention.backend import AttentionBackend, AttentionInputs, AttentionMetadata
from kvserve.attention.torch_ref import TorchRefBackend, TorchRefMetadata, _validate
from kvserve.kv.storage import KVCacheStorage
from kvserve.native import kernel_range, load_library

KERNEL_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
DECODE_KERNEL_RANGE = "kvserve::paged_decode"  # the kernel's name in torch.profiler traces (a ctypes call is no op)
_C_ARG_TYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]  # out, its row stride, q, its row stride
    + [ctypes.c_void_p] * 2 + [ctypes.c_int64]  # k/v caches, num_blocks
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # block tables + stride, seq lens
    + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]  # num_seqs .. window, scale, num_threads
)


@dataclass(frozen=True)
class CpuPagedMetadata(AttentionMetadata):
    """The step's inputs, the decodes' kernel arguments, and the prefill chunks as a reference sub-step."""

    inputs: AttentionInputs
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks], contiguous
    decode_seq_lens: torch.Tensor  # int32 [num_decodes], contiguous
    prefill: TorchRefMetadata | None  # None: the step has no prefill chunk


class CpuPagedBackend(AttentionBackend):
    """Decodes through the in-place C kernel, prefill chunks through ``TorchRefBackend``; fp32 on CPU only.

    Construction builds (or loads the cached) kernel and raises ``KernelBuildError`` when it cannot.
    """

    def __init__(self) -> None:
        self._decode = decode_kernel()
        self._prefill = TorchRefBackend()

    def build_metadata(self, inputs: AttentionInputs, sliding_windows: set[int | None]) -> CpuPagedMetadata:
        _validate(inputs)
        if inputs.seq_lens.device.type != "cpu":
            raise ValueError(f"CpuPagedBackend runs on CPU; the step's tensors are on {inputs.seq_lens.device}")
        num_decodes = inputs.num_decodes
        if num_decodes and max(inputs.seq_lens_list[:num_decodes]) > inputs.block_tables.shape[1] * inputs.block_size:
            raise ValueError(f"the block tables ({inputs.block_tables.shape[1]} blocks wide) are too narrow for "
                             f"decodes of up to {max(inputs.seq_lens_list[:num_decodes])} tokens")
        chunks = _prefill_substep(inputs) if num_decodes < inputs.num_seqs else None
        return CpuPagedMetadata(
            inputs=inputs,
            decode_block_tables=inputs.block_tables[:num_decodes].to(torch.int32).contiguous(),
            decode_seq_lens=inputs.seq_lens[:num_decodes].to(torch.int32).contiguous(),
            prefill=self._prefill.build_metadata(chunks, sliding_windows) if chunks is not None else None,
        )

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
        if not isinstance(meta, CpuPagedMetadata):
            raise TypeError(f"CpuPagedBackend needs CpuPagedMetadata, got {type(meta).__name__}")
        _check_shapes(q, k, kv, layer, meta.inputs)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding window must be a positive number of tokens, got {sliding_window}")
        num_decodes = meta.inputs.num_decodes
        out = torch.empty(q.shape, dtype=q.dtype)
        if num_decodes:
            kv.write(layer, meta.inputs.slot_mapping[:num_decodes], k[:num_decodes], v[:num_decodes])
            self._attend_decodes(q, out, layer, kv, meta, scale, sliding_window)
        if meta.prefill is not None:  # writes the chunks' K/V itself
            out[num_decodes:] = self._prefill.forward(
                q[num_decodes:], k[num_decodes:], v[num_decodes:], layer, kv, meta.prefill,
                scale=scale, sliding_window=sliding_window,
            )
        return out

    def _attend_decodes(
        self, q: torch.Tensor, out: torch.Tensor, layer: int, kv: KVCacheStorage, meta: CpuPagedMetadata,
        scale: float, sliding_window: int | None,
    ) -> None:
        num_heads, head_dim = q.shape[1:]
        if q.stride(2) != 1 or q.stride(1) != head_dim:  # the kernel walks heads head_dim apart within a row
            q = q.contiguous()
        tables, num_kv_heads, layer_kv = meta.decode_block_tables, kv.spec.num_kv_heads, kv.layer(layer)
        with kernel_range(DECODE_KERNEL_RANGE):
            num_bad = self._decode(
                out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0),
                layer_kv.k.data_ptr(), layer_kv.v.data_ptr(), kv.num_blocks,
                tables.data_ptr(), tables.stride(0), meta.decode_seq_lens.data_ptr(), meta.inputs.num_decodes,
                num_kv_heads, num_heads // num_kv_heads, head_dim, meta.inputs.block_size, sliding_window or 0, scale,
                torch.get_num_threads(),
            )
        if num_bad < 0:
            raise MemoryError("the decode kernel could not allocate its plan of shared-prefix groups")
        if num_bad:
            raise ValueError(f"a decode's block table names a block outside the cache's {kv.num_blocks} blocks")


def _prefill_substep(inputs: AttentionInputs) -> AttentionInputs:
    """The step without its decodes: the chunks' rows, renumbered from 0."""
    first = inputs.num_decodes
    query_start_loc = inputs.query_start_loc[first:]
    return replace(
        inputs,
        num_decodes=0,
        query_start_loc=query_start_loc - query_start_loc[0],
        seq_lens=inputs.seq_lens[first:],
        block_tables=inputs.block_tables[first:],
        slot_mapping=inputs.slot_mapping[first:],  # decodes have one token each, so rows == sequences
        query_lens_list=inputs.query_lens_list[first:],
        seq_lens_list=inputs.seq_lens_list[first:],
    )


def _check_shapes(q: torch.Tensor, k: torch.Tensor, kv: KVCacheStorage, layer: int, inputs: AttentionInputs) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if (num_tokens != inputs.num_tokens or num_heads % k.shape[1] or k.shape[1] != kv.spec.num_kv_heads
            or head_dim != kv.spec.head_dim):
        raise ValueError(
            f"q {tuple(q.shape)} / k {tuple(k.shape)} do not fit a step of {inputs.num_tokens} tokens with "
            f"num_heads a multiple of the cache's num_kv_heads={kv.spec.num_kv_heads} and head_dim={kv.spec.head_dim}"
        )
    layer_kv = kv.layer(layer)
    paged = (layer_kv.k, layer_kv.v)
    if (q.dtype != torch.float32 or layer_kv.k_scale is not None
            or any(c.dtype != torch.float32 or not c.is_contiguous() for c in paged)):
        raise TypeError(f"CpuPagedBackend needs fp32 queries and contiguous, unquantized fp32 caches; got {q.dtype} "
                        f"and a {kv.spec.kv_dtype.name} cache")


# --- the kernel ---------------------------------------------------------------------------------------------------


def decode_kernel() -> Callable[..., int]:
    """The compiled ``kvserve_paged_decode_f32``; raises ``KernelBuildError`` (every time) if it cannot be had."""
    function = load_library(KERNEL_SOURCE).kvserve_paged_decode_f32
    function.argtypes = _C_ARG_TYPES
    function.restype = ctypes.c_int
    return function
