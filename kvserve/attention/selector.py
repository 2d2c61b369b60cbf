"""The one place that picks the attention backend for a device and dtype.

fp32 on CPU gets ``CpuPagedBackend`` when its kernel builds, else ``TorchRefBackend`` with a warning (once per
process); every other device or dtype gets ``TorchRefBackend``. ``KVSERVE_ATTENTION_BACKEND`` (``cpu_paged`` or
``torch_ref``) forces one, e.g. to compare them or to rule the kernel out.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.native import KernelBuildError

BACKEND_ENV_VAR = "KVSERVE_ATTENTION_BACKEND"
BACKEND_NAMES = ("cpu_paged", "torch_ref")

logger = logging.getLogger(__name__)


def select_backend(device: torch.device, dtype: torch.dtype, name: str | None = None) -> AttentionBackend:
    """The backend for a model on ``device`` in ``dtype``; ``name`` (default: ``$KVSERVE_ATTENTION_BACKEND``)
    forces one of ``BACKEND_NAMES``, and a forced ``cpu_paged`` that cannot run raises instead of falling back."""
    name = name or os.environ.get(BACKEND_ENV_VAR) or None
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r} (from {BACKEND_ENV_VAR}?); choose one of {BACKEND_NAMES}")
    if name == "torch_ref":
        return TorchRefBackend()
    if name == "cpu_paged":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"the cpu_paged attention backend runs fp32 on CPU, not {dtype} on {device}")
        return CpuPagedBackend()
    if device.type != "cpu" or dtype != torch.float32:
        return TorchRefBackend()
    try:
        return CpuPagedBackend()
    except KernelBuildError as error:
        _warn_fallback(str(error))
        return TorchRefBackend()


@functools.cache
def _warn_fallback(reason: str) -> None:
    logger.warning("CPU attention falls back to the slower TorchRefBackend: %s", reason)
