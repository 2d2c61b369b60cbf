"""Each row's argmax, the first of equal maxima (a NaN counting as the largest), as ``torch.argmax`` gives it:
the last op of greedy decoding and of the exponential race that draws random samples.

On CPU, fp32 rows go to ``csrc/first_max.c`` (two vector passes over a row, a long row split among the threads):
torch's index-returning reductions walk a row one value at a time, 0.3 ms for one 262,144-token row of Gemma 3's
logits. On CUDA, rows of a model dtype go to ``triton_first_max`` (two launches: each row cut into parts, one
program a part, then one program a row merging them; torch's reduction took 27 us of a 128,256-token row). ``reference_first_max`` is the plain-PyTorch twin, and serves every other device and
dtype.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvserve.native import load_library, optional_kernel

logger = logging.getLogger(__name__)

FIRST_MAX_SOURCE = Path(__file__).parent / "csrc" / "first_max.c"
CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the Triton kernel compares exactly in fp32


def first_max(x: torch.Tensor) -> torch.Tensor:
    """The int64 index of each row's first maximum of ``x`` [..., V] (V >= 1), on ``x``'s device."""
    if x.device.type == "cuda" and x.dtype in CUDA_DTYPES and x.dim() >= 1 and x.shape[-1] and x.stride(-1) == 1:
        from kvserve.sample.triton_first_max import triton_first_max  # imports triton: CUDA only

        return triton_first_max(x)
    library = _library() if _kernel_takes(x) else None
    return reference_first_max(x) if library is None else kernel_first_max(x, library)


def kernel_first_max(x: torch.Tensor, library: ctypes.CDLL) -> torch.Tensor:
    """``first_max`` by the kernel of ``library`` (``bind``-ed) on fp32 CPU rows whose values are contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if rows.shape[0]:
        library.kvserve_first_max(out.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1],
                                  torch.get_num_threads())
    return out.view(x.shape[:-1])


def reference_first_max(x: torch.Tensor) -> torch.Tensor:
    """The twin: ``max``'s indices, which torch computes in a third of argmax's time on CPU (measured at 16-64
    rows of a 49,152-token vocabulary) and which are argmax's."""
    return x.max(dim=-1).indices


def _kernel_takes(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0
            and x.stride(-1) == 1)


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """``library`` (built from ``FIRST_MAX_SOURCE``) with its function's C signature set."""
    library.kvserve_first_max.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                          ctypes.c_int64, ctypes.c_int]
    library.kvserve_first_max.restype = None
    return library


_library = optional_kernel(lambda: bind(load_library(FIRST_MAX_SOURCE)),
                          "argmax falls back to torch's slower reduction", logger)
