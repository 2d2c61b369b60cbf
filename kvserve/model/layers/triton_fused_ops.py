"""The elementwise ops between a decoder layer's GEMMs as Triton kernels for CUDA: one launch each where the
plain-PyTorch twin (``TorchFusedOps``) takes several.

A decode step of a small model, or of any model at one stream, is a chain of short kernels; inside a CUDA
graph each still costs its launch latency and its tail. Per layer the twin runs the residual add and the norm
apart (twice), the rotary embedding as eight ops (two halves, four products, a sum, a difference, a concat, a
copy back) and the activation and product as two; here each is one kernel. All arithmetic is fp32, rounded
once to the model's dtype where the twin rounds after each op: fp32 results agree with the twin to rounding,
fp16 / bf16 ones within an ulp or two of the output dtype.

Runs on CUDA; on CPU only under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported),
which is how CI tests it against the twin. Inputs a kernel does not take (other activations, a sandwich norm
whose eps or convention differs from the norm after it, rows that are not contiguous) go to the twin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvserve.model.layers.fused_ops import TorchFusedOps
from kvserve.model.layers.activation import KERNEL_ACTIVATIONS
from kvserve.model.layers.triton_tiles import gated_activation
from kvserve.triton_launch import enter_chain, pdl_options

if TYPE_CHECKING:
    from kvserve.model.layers.activation import GatedMLP
    from kvserve.model.layers.norm import RMSNorm

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACT_BLOCK = 1024  # columns of act_and_mul per program


@triton.jit
def _rms_scaled(x, weight_ptr, offs, mask, n, offset, eps):
    """``x / rms(x) * (offset + weight)`` of one fp32 row."""
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x * inv_rms * (offset + weight)


@triton.jit
def add_rms_norm_kernel(out, residual, x, x_norm_weight, weight, stride_out, stride_res, stride_x, n, offset, eps,
                        HAS_RESIDUAL: tl.constexpr, HAS_X_NORM: tl.constexpr, BLOCK_N: tl.constexpr,
                        PDL: tl.constexpr):
    """One program per row: ``out = norm(x)``; with a residual, ``residual += x`` (``x_norm(x)``, rounded to the
    dtype, with ``HAS_X_NORM``: Gemma's sandwich norm) in place, rounded as stored, then ``out = norm(residual)``."""
    enter_chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n
    h = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        if HAS_X_NORM:
            h = _rms_scaled(h, x_norm_weight, offs, mask, n, offset, eps).to(x.dtype.element_ty).to(tl.float32)
        r_ptrs = residual + row * stride_res + offs
        stored = (tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32) + h).to(residual.dtype.element_ty)
        tl.store(r_ptrs, stored, mask=mask)
        h = stored.to(tl.float32)
    normed = _rms_scaled(h, weight, offs, mask, n, offset, eps)
    tl.store(out + row * stride_out + offs, normed.to(out.dtype.element_ty), mask=mask)


@triton.jit
def head_rms_norm_kernel(heads, stride_t, weight, num_heads, head_dim, offset, eps,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One program per token: each of its heads [num_heads, head_dim] normalized in place by one weight."""
    enter_chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    mask = (offs_h[:, None] < num_heads) & mask_d[None, :]
    ptrs = heads + row * stride_t + offs_h[:, None] * head_dim + offs_d[None, :]
    h = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 1) / head_dim + eps)
    w = offset + tl.load(weight + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    tl.store(ptrs, (h * inv_rms[:, None] * w[None, :]).to(heads.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(qk, stride_t, cos, sin, stride_cos, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    """One program per token: its q and k heads [num_heads, 2 * HALF] rotated in place (HF's half-split
    convention): ``(x1 * c - x2 * s, x2 * c + x1 * s)``."""
    enter_chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h[:, None] < num_heads) & mask_d[None, :]
    c = tl.load(cos + row * stride_cos + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin + row * stride_cos + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    first = qk + row * stride_t + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * c - x2 * s).to(qk.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * c + x1 * s).to(qk.dtype.element_ty), mask=mask)


@triton.jit
def act_and_mul_kernel(out, gate_up, stride_out, stride_in, n, ACT: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    """Program (row, column block): ``act(gate) * up`` of the row's packed [gate | up] (``gated_activation``)."""
    enter_chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_up + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * stride_in + n + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_out + offs, gated_activation(gate, up, ACT).to(out.dtype.element_ty), mask=mask)


def norm_warps(block: int) -> int:
    """Warps for one row's norm: 4 up to 2,048 values, 8 to 8,192, then 16 (16 bytes a load and a few loads in
    flight per thread; a decode step's norms are a few microseconds each, bound by their loads' latency)."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


class TritonFusedOps(TorchFusedOps):
    """The ops as single Triton kernels on the model's device (CUDA, or CPU tensors under the interpreter), in
    the model's dtype; the twin for what they do not take."""

    def rms_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None, x_norm: RMSNorm | None = None
    ) -> torch.Tensor:
        if (x.dim() != 2 or x.stride(1) != 1 or x.dtype not in MODEL_DTYPES
                or (residual is not None and (residual.stride(1) != 1 or residual.dtype != x.dtype))
                or (x_norm is not None and (x_norm.eps, x_norm.weight_offset) != (norm.eps, norm.weight_offset))):
            return super().rms_norm(norm, x, residual, x_norm)
        rows, n = x.shape
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if rows:
            block = triton.next_power_of_2(n)
            add_rms_norm_kernel[(rows,)](
                out, x if residual is None else residual, x, norm.weight if x_norm is None else x_norm.weight,
                norm.weight, out.stride(0), 0 if residual is None else residual.stride(0), x.stride(0), n,
                norm.weight_offset, norm.eps, HAS_RESIDUAL=residual is not None, HAS_X_NORM=x_norm is not None,
                BLOCK_N=block, num_warps=norm_warps(block), **pdl_options(x.device),
            )
        return out

    def head_rms_norm_(self, norm: RMSNorm, heads: torch.Tensor) -> None:
        rows, num_heads, head_dim = heads.shape
        if heads.stride()[1:] != (head_dim, 1) or norm.weight.shape != (head_dim,) or heads.dtype not in MODEL_DTYPES:
            return super().head_rms_norm_(norm, heads)
        if rows:
            head_rms_norm_kernel[(rows,)](heads, heads.stride(0), norm.weight, num_heads, head_dim, norm.weight_offset,
                                          norm.eps, BLOCK_H=triton.next_power_of_2(num_heads),
                                          BLOCK_D=triton.next_power_of_2(head_dim), **pdl_options(heads.device))

    def rotary_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        rows, num_heads, head_dim = qk.shape
        if (qk.stride()[1:] != (head_dim, 1) or 2 * cos.shape[-1] != head_dim or qk.dtype not in MODEL_DTYPES
                or cos.stride(-1) != 1 or cos.stride() != sin.stride() or cos.shape != sin.shape
                or cos.shape[0] != rows):  # one row of cos / sin a token (the twin also broadcasts)
            return super().rotary_(qk, cos, sin)
        if rows:
            half = head_dim // 2
            rotary_kernel[(rows,)](qk, qk.stride(0), cos, sin, cos.stride(0), num_heads, HALF=half,
                                   BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
                                   **pdl_options(qk.device))

    def act_and_mul(self, mlp: GatedMLP, gate_up: torch.Tensor) -> torch.Tensor:
        activation = KERNEL_ACTIVATIONS.get(mlp.activation)
        if activation is None or gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.dtype not in MODEL_DTYPES:
            return super().act_and_mul(mlp, gate_up)
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            act_and_mul_kernel[(rows, triton.cdiv(n, ACT_BLOCK))](out, gate_up, out.stride(0), gate_up.stride(0), n,
                                                                  ACT=activation, BLOCK=ACT_BLOCK,
                                                                  **pdl_options(gate_up.device))
        return out
