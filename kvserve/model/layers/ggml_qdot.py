"""The block kernel's int8-activation path (``csrc/ggml_qdot.c``): each row of x quantized into blocks of 32 int8
codes with an fp32 scale (llama.cpp's Q8 activations), then integer dot products with the weight's blocks.

This changes the numerics on purpose, as llama.cpp does: the result is exactly that of x's quantized values
(``quantize_activations``, the twin, equal bit for bit to the kernel's quantization) times the dequantized
weight, up to the order of fp32 sums; each value of x moves by at most half its block's scale, so ``y`` moves
from the exact kernel's by at most ``activation_error_bound``. Steps of any size run on the blocks (the column
tiles to ``QDOT_MAX_ROWS`` rows, then the int8 strips kernel, faster than a dense fp32 copy), so none is kept.
``ggml.GGMLGemm`` stays the exact path (``--no-quantize-activations``). On the default model:
tests/engine/test_real_models.py states the bound.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvserve.model.layers.ggml import BLOCK_GEMM_ARG_TYPES, KERNEL_TYPES, GGMLTensor, call_block_kernel
from kvserve.native import KernelFunction, load_library, optional_kernel

logger = logging.getLogger(__name__)

GGML_QDOT_SOURCE = Path(__file__).parent / "csrc" / "ggml_qdot.c"
GGML_QDOT_RANGE = "kvserve::ggml_qdot"  # the kernel's name in torch.profiler traces
ACTIVATION_BLOCK = 32  # values of x per int8 block (one scale)
# the column tiles up to 4 rows, then the int8 strips kernel (``batched``), which beats the dense panels at every
# larger step, so that ``--quantize-activations`` keeps no dense copy: one step's GEMMs of SmolLM2 (2 threads,
# Zen 5) at 4 rows 8.0 ms against the strips' 8.3, at 5 rows 10.1 against 8.3 (forced AVX2: the same crossover);
# the strips against the dense panels in csrc/ggml_qdot.c
QDOT_MAX_ROWS = 4


class QuantizedActivations(NamedTuple):
    """Rows of x in blocks of ``ACTIVATION_BLOCK``: ``codes`` int8 [m, k], per block its scale ``dx`` and
    ``dx * sum(codes)`` (``sx``), fp32 [m, k / 32]."""

    codes: torch.Tensor
    dx: torch.Tensor
    sx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        m, k = self.codes.shape
        blocks = self.codes.view(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK).float() * self.dx.unsqueeze(-1)
        return blocks.view(m, k)


def quantize_activations(x: torch.Tensor) -> QuantizedActivations:
    """The twin of the kernel's quantization, bit for bit: per block of 32, ``dx = max|x| / 127``,
    ``codes = round_half_even(x * (1 / dx))`` (0 where dx is 0), ``sx = dx * sum(codes)``. As in the kernel (and
    llama.cpp), a NaN in x is left out of its block's max and its code is 0; so is every code that is not finite
    (an inf's block, whose dx is inf and sx NaN; a block so small that 1 / dx is inf)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    dx = blocks.abs().nan_to_num(nan=0.0, posinf=torch.inf).amax(dim=-1) / 127
    inverse = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    codes = torch.round(blocks * inverse.unsqueeze(-1))
    codes = torch.where(codes.isfinite(), codes, torch.zeros_like(codes))
    return QuantizedActivations(codes.to(torch.int8).view(m, k), dx, dx * codes.sum(dim=-1))


def reference_qdot_linear(x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The twin of ``QDotGemm``: x quantized as the kernel does and dequantized, times gguf's dequantized
    weight."""
    return F.linear(quantize_activations(x).dequantize(), weight.dequantize(), bias)


def activation_error_bound(x: torch.Tensor, weight: GGMLTensor) -> torch.Tensor:
    """[m, n]: how far the int8 path's result may be from the exact one's (``ggml.reference_linear``), fp32
    rounding aside: each value of x moves by at most half its block's scale, so ``sum_k |w| * dx / 2``."""
    half_steps = quantize_activations(x).dx.repeat_interleave(ACTIVATION_BLOCK, dim=1) / 2
    return half_steps @ weight.dequantize().abs().T


class QDotGemm:
    """The compiled kernel: ``x [M, K] @ W.T (+ bias)`` with x quantized to int8 blocks, for W a ``GGMLTensor``
    of a type in ``KERNEL_TYPES``; serves ``GGMLLinearMethod``'s steps of up to ``max_rows`` rows, and through
    ``batched`` (the int8 strips kernel) every larger one."""

    max_rows = QDOT_MAX_ROWS
    types = KERNEL_TYPES

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        """``library``: a build of ``GGML_QDOT_SOURCE`` (default: this process's, for its CPU)."""
        library = library or load_library(GGML_QDOT_SOURCE, batch_invariant=False)
        self._gemm = KernelFunction(library.kvserve_ggml_qdot_gemm, BLOCK_GEMM_ARG_TYPES, ctypes.c_int)
        self._strips = KernelFunction(library.kvserve_ggml_qdot_gemm_strips, BLOCK_GEMM_ARG_TYPES, ctypes.c_int)
        self._quantize = KernelFunction(library.kvserve_ggml_quantize_rows,
                                        [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_int] * 2)

    def __call__(self, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        return call_block_kernel(self._gemm, "ggml int8 GEMM", GGML_QDOT_RANGE, x, weight, bias, out)

    def batched(self, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The product for a step of any number of rows: these column tiles up to ``max_rows`` rows, then the
        int8 strips kernel (each weight decoded once a call), the same numerics."""
        if x.shape[0] <= self.max_rows:
            return self(x, weight, bias, out)
        return call_block_kernel(self._strips, "ggml int8 strips GEMM", GGML_QDOT_RANGE, x, weight, bias, out)

    def quantize_activations(self, x: torch.Tensor) -> QuantizedActivations:
        """The kernel's own quantization of x [m, k] (fp32, k a multiple of 32), for tests against the twin."""
        m, k = x.shape
        if x.dtype != torch.float32 or k % ACTIVATION_BLOCK or x.stride(1) != 1:
            raise ValueError(f"quantize: x {tuple(x.shape)} {x.dtype} is not fp32 rows of whole blocks of 32")
        codes = torch.empty(m, k, dtype=torch.int8)
        dx, sx = torch.empty(m, k // ACTIVATION_BLOCK), torch.empty(m, k // ACTIVATION_BLOCK)
        self._quantize(codes.data_ptr(), dx.data_ptr(), sx.data_ptr(), x.data_ptr(), x.stride(0), m, k)
        return QuantizedActivations(codes, dx, sx)


qdot_gemm = optional_kernel(QDotGemm, "GGUF blocks multiply fp32 activations", logger)
