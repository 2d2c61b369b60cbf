"""Storing a step's new K/V into a CPU cache in one C call a layer (``csrc/kv_store.c``), quantized on the way
where the cache is; ``KVCacheStorage.write`` takes it for every CPU cache whose inputs it reads and keeps its
torch path (``kv/quant.py``'s ``quantize``, then ``index_copy_``) as the twin and for everything else.

Through torch, a one-stream decode step of SmolLM2 spent 0.9 ms of 12.6 in an unquantized cache's two
``index_copy_`` calls a layer, and 20 ms of 34 quantizing an int8 cache's rows (a dozen ops a tensor a layer).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvserve.kv.quant import C_ENCODING_CODES, ENCODINGS
from kvserve.native import KernelFunction, load_library, optional_kernel

logger = logging.getLogger(__name__)

KV_STORE_SOURCE = Path(__file__).parent / "csrc" / "kv_store.c"
_ARG_TYPES = ([ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
              + [ctypes.c_int] * 5 + [ctypes.c_int64])


class CpuKVStore:
    """The compiled store: ``takes`` says whether a write is one it does, calling it does it."""

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        self._store = KernelFunction((library or load_library(KV_STORE_SOURCE)).kvserve_store_kv, _ARG_TYPES,
                                     ctypes.c_int)

    @staticmethod
    def takes(data: torch.Tensor, params: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
              encoding: str) -> bool:
        """A CPU cache, the new rows [T, heads, head_dim] with heads and values contiguous in each token's row,
        in the cache's own dtype where unquantized and fp32 where quantized (the C code's encodings)."""
        if data.device.type != "cpu" or k.device.type != "cpu" or v.device.type != "cpu":
            return False
        values = (params is None and k.dtype == data.dtype) or (params is not None and encoding in ENCODINGS
                                                                and k.dtype == torch.float32)
        head_dim = k.shape[-1]
        return values and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (k, v))

    def __call__(self, k_data: torch.Tensor, v_data: torch.Tensor, k_params: torch.Tensor | None,
                 v_params: torch.Tensor | None, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 encoding: str) -> None:
        """Store k and v ([T, num_kv_heads, head_dim]) at slots ``slot_mapping`` (int64 [T]) of the paged data
        (and fp16 parameters, quantized caches) ``[blocks, block_size, num_kv_heads, ...]``; a slot outside the
        cache raises ValueError and nothing is stored."""
        num_tokens, num_heads, head_dim = k.shape
        num_slots = k_data.shape[0] * k_data.shape[1]
        status = self._store(
            k_data.data_ptr(), v_data.data_ptr(), None if k_params is None else k_params.data_ptr(),
            None if v_params is None else v_params.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            slot_mapping.data_ptr(), num_tokens, num_heads, head_dim, k.element_size(),
            C_ENCODING_CODES[encoding] if k_params is not None else 0, num_slots)
        if status:
            raise ValueError(f"a slot of the step is outside the cache's {num_slots} slots")


cpu_kv_store = optional_kernel(CpuKVStore, "KV writes on CPU take the slower torch path", logger)
