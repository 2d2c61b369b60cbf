"""The fused ops for fp32 on CPU: one C kernel call (``csrc/fused_ops.c``) per op where the twin runs several
PyTorch ops, each allocating its result and passing over memory again.

Per layer of a Llama-shaped model the twin calls 16 PyTorch ops between the GEMMs (the residual add and RMSNorm,
itself six ops inside, twice; rotary's halves, four multiplies, a subtract, an add, a cat and the copy back; the
halves of gate_up, SiLU and the multiply); the kernels make four calls. Measured at SmolLM2-135M's shapes (hidden 576, 9 + 3 heads of 64, intermediate 1536), one
layer's four ops, µs, the median of 300 layer runs (in brackets the fastest: another job shared the 2 cores),
with ``benchmarks/cpu_fused_ops.py --threads N`` on the AVX2 machine (2-core AMD EPYC Zen 2), kernels built for
it (native; the ``KVSERVE_CPU_ISA=avx2`` build measured alike: 179 µs at 1 token, 206 at 16)::

    tokens in the step          1            4           16          512
    2 threads  twin        342 (239)    297 (265)    384 (349)   17616 (3060)
               compiled   7296 (498)    642 (564)    667 (604)   13602 (2904)
               kernels     197 (110)    136 (124)    189 (177)    9843 (1657)
    1 thread   twin        263 (236)    311 (271)    456 (369)    5858 (5038)
               compiled    548 (499)    641 (570)    787 (664)    5163 (4585)
               kernels     121 (110)    145 (129)    214 (185)    3228 (2877)

The kernels take about half the twin's time at every size. ``torch.compile`` of the twin (inductor's C++ with
OpenMP, dynamic shapes) also fuses each op, but its guards and wrapper cost ~100 µs more per call than a ctypes
call, which is what decode steps are made of, and its 512-token kernels came out slower than these.
SiLU-and-multiply is the one op the kernels do not speed up at decode sizes (their vector exponential costs about
what PyTorch's does); at 512 tokens it is one pass instead of two, on both threads.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvserve.model.layers.activation import KERNEL_ACTIVATIONS, GatedMLP
from kvserve.model.layers.fused_ops import TorchFusedOps
from kvserve.model.layers.norm import RMSNorm
from kvserve.native import KernelFunction, kernel_range, load_library, optional_kernel

logger = logging.getLogger(__name__)

FUSED_OPS_SOURCE = Path(__file__).parent / "csrc" / "fused_ops.c"
FUSED_OPS_RANGE = "kvserve::fused_ops"  # the kernels' name in torch.profiler traces (a ctypes call is no op)
_PTR, _STRIDE, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_NORM_ARG_TYPES = [_PTR, _STRIDE, _PTR, _STRIDE, _PTR, _STRIDE, _PTR, _PTR, ctypes.c_float, ctypes.c_float,
                   _INT, _INT, _INT]  # out, residual, x (each + row stride), x weight, weight, offset, eps,
# rows, n, threads
_ROTARY_ARG_TYPES = [_PTR, _STRIDE, _PTR, _PTR, _INT, _INT, _INT, _INT]  # x + row stride, cos, sin, rows, heads,
# head_dim, threads
_HEAD_NORM_ARG_TYPES = [_PTR, _STRIDE, _PTR, ctypes.c_float, ctypes.c_float, _INT, _INT, _INT, _INT]  # x + row
# stride, weight, offset, eps, rows, heads, head_dim, threads
_ACT_ARG_TYPES = [_PTR, _STRIDE, _PTR, _STRIDE, _INT, _INT, _INT, _INT]  # out, gate_up (+ row strides), rows, n,
# activation, threads


class CpuFusedOps(TorchFusedOps):
    """The ops by ``csrc/fused_ops.c``, fp32 on CPU only (``select_fused_ops`` binds it to such models alone);
    what the kernels do not take (an erf GELU, a partial rotary, heads not laid out one after another) goes to
    the twin."""

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        """``library``: a build of ``FUSED_OPS_SOURCE`` (default: this process's, for its CPU)."""
        library = library or load_library(FUSED_OPS_SOURCE)
        self._norm = KernelFunction(library.kvserve_add_rms_norm_f32, _NORM_ARG_TYPES)
        self._head_norm = KernelFunction(library.kvserve_head_rms_norm_f32, _HEAD_NORM_ARG_TYPES)
        self._rotary = KernelFunction(library.kvserve_rotary_f32, _ROTARY_ARG_TYPES)
        self._act_and_mul = KernelFunction(library.kvserve_act_and_mul_f32, _ACT_ARG_TYPES)

    def rms_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None, x_norm: RMSNorm | None = None
    ) -> torch.Tensor:
        x_strides = x.stride()
        residual_strides = (0, 1) if residual is None else residual.stride()
        if (len(x_strides) != 2 or x_strides[1] != 1 or residual_strides[1] != 1
                or (x_norm is not None and (x_norm.eps, x_norm.weight_offset) != (norm.eps, norm.weight_offset))):
            return super().rms_norm(norm, x, residual, x_norm)
        rows, n = x.shape
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows:
            with kernel_range(FUSED_OPS_RANGE):
                self._norm(out.data_ptr(), n, None if residual is None else residual.data_ptr(), residual_strides[0],
                           x.data_ptr(), x_strides[0],
                           None if x_norm is None else x_norm.weight.data_ptr(), norm.weight.data_ptr(),
                           norm.weight_offset, norm.eps, rows, n, torch.get_num_threads())
        return out

    def head_rms_norm_(self, norm: RMSNorm, heads: torch.Tensor) -> None:
        rows, num_heads, head_dim = heads.shape
        strides = heads.stride()
        if strides[1:] != (head_dim, 1) or norm.weight.shape != (head_dim,):
            return super().head_rms_norm_(norm, heads)
        if rows:
            with kernel_range(FUSED_OPS_RANGE):
                self._head_norm(heads.data_ptr(), strides[0], norm.weight.data_ptr(), norm.weight_offset, norm.eps,
                                rows, num_heads, head_dim, torch.get_num_threads())

    def rotary_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        rows, num_heads, head_dim = qk.shape
        strides = qk.stride()
        if (strides[1:] != (head_dim, 1) or 2 * cos.shape[-1] != head_dim
                or not (cos.is_contiguous() and sin.is_contiguous())):
            return super().rotary_(qk, cos, sin)
        if rows:
            with kernel_range(FUSED_OPS_RANGE):
                self._rotary(qk.data_ptr(), strides[0], cos.data_ptr(), sin.data_ptr(), rows, num_heads,
                             head_dim, torch.get_num_threads())

    def act_and_mul(self, mlp: GatedMLP, gate_up: torch.Tensor) -> torch.Tensor:
        activation, strides = KERNEL_ACTIVATIONS.get(mlp.activation), gate_up.stride()
        if activation is None or len(strides) != 2 or strides[1] != 1:
            return super().act_and_mul(mlp, gate_up)
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows:
            with kernel_range(FUSED_OPS_RANGE):
                self._act_and_mul(out.data_ptr(), n, gate_up.data_ptr(), strides[0], rows, n, activation,
                                  torch.get_num_threads())
        return out


cpu_fused_ops = optional_kernel(CpuFusedOps, "CPU elementwise ops run op by op in PyTorch", logger)


def can_fuse(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32
