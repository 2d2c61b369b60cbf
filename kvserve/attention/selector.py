"""The one place that picks the attention backend for a device and dtype.

On CUDA, fp16 / bf16 / fp32 models get ``TritonPagedBackend`` when triton imports and the kernels read the
cache's encoding (unquantized, int8, fp8, int4), else ``TorchRefBackend`` with a warning (once per process). fp32 on
CPU gets ``CpuPagedBackend`` when its kernel builds, else ``TorchRefBackend`` with a warning; every other CPU
dtype gets ``TorchRefBackend``. A run may force one (``--attention-backend``, or ``$KVSERVE_ATTENTION_BACKEND``,
which ``EngineArgs`` reads: ``cpu_paged``, ``torch_ref`` or ``triton``), e.g. to compare them or to rule a kernel
out; ``triton`` on CPU runs only under Triton's interpreter (``TRITON_INTERPRET=1``, as the tests do). triton is
imported here only when it is picked, so kvserve imports without it.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.config import ATTENTION_BACKENDS
from kvserve.kv.quant import KVCacheDtype
from kvserve.native import KernelBuildError

logger = logging.getLogger(__name__)


def select_backend(device: torch.device, dtype: torch.dtype, name: str | None = None,
                   kv_dtype: KVCacheDtype | None = None) -> AttentionBackend:
    """The backend for a model on ``device`` in ``dtype`` whose cache is stored as ``kv_dtype`` (None: ``dtype``
    itself); ``name`` forces one of ``config.ATTENTION_BACKENDS``, and a forced ``cpu_paged`` or ``triton`` that
    cannot run raises instead of falling back."""
    if name is not None and name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "torch_ref":
        return TorchRefBackend()
    if name == "cpu_paged":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"the cpu_paged attention backend runs fp32 on CPU, not {dtype} on {device}")
        return CpuPagedBackend()
    if name == "triton":
        return _triton_backend(device, dtype, kv_dtype)
    if device.type == "cuda":
        try:
            return _triton_backend(device, dtype, kv_dtype)
        except (ImportError, ValueError) as error:
            _warn_fallback("CUDA", str(error))
            return TorchRefBackend()
    if device.type != "cpu" or dtype != torch.float32:
        return TorchRefBackend()
    try:
        return CpuPagedBackend()
    except KernelBuildError as error:
        _warn_fallback("CPU", str(error))
        return TorchRefBackend()


def _triton_backend(device: torch.device, dtype: torch.dtype, kv_dtype: KVCacheDtype | None) -> AttentionBackend:
    """``TritonPagedBackend``, or ImportError (no triton) / ValueError (a case its kernels do not run)."""
    from kvserve.attention import triton_paged  # imports triton

    encoding = kv_dtype or KVCacheDtype.unquantized(dtype)
    if dtype not in triton_paged.MODEL_DTYPES or not triton_paged.can_read(encoding):
        raise ValueError(f"the triton attention backend runs fp16 / bf16 / fp32 models on caches stored "
                         f"unquantized or as {' / '.join(triton_paged.QUANTIZED_ENCODINGS)}, not {dtype} on "
                         f"a {encoding.name} cache")
    if device.type != "cuda" and not triton_paged.is_interpreted():
        raise ValueError(f"the triton attention backend runs on CUDA, or on {device} under TRITON_INTERPRET=1")
    return triton_paged.TritonPagedBackend()


@functools.cache
def _warn_fallback(device_type: str, reason: str) -> None:
    logger.warning("%s attention falls back to the slower TorchRefBackend: %s", device_type, reason)
