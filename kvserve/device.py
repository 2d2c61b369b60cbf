"""Where a run computes and in what dtype: the configuration's ``device`` and ``dtype`` names as torch's.

Apart from ``config.py`` because it needs torch (``torch.cuda.is_available``, the dtypes themselves), which the
configuration and the command line do without.
"""

from __future__ import annotations

import torch

from kvserve.config import TORCH_DTYPE_NAMES, check_device_name, check_dtype_name


def parse_dtype(name: str | torch.dtype, device: str) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype; ``auto`` is fp32 on CPU and bf16 on CUDA."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    check_dtype_name(name)
    return getattr(torch, TORCH_DTYPE_NAMES[name])


def resolve_device(device: str) -> str:
    """``auto`` picks CUDA when it is there; an explicit ``cuda`` without a GPU is an error that says so."""
    check_device_name(device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return device
