"""What the Triton GEMMs over quantized weights (``triton_ggml``, ``triton_weight_only``) share: a tile's product
with weight values built in fp32 registers, and the tile's epilogue."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def accumulate_dot(acc, xs, values):
    """``acc + xs @ values.T`` for x's [BLOCK_M, BLOCK_K] tile and fp32 weight values [BLOCK_N, BLOCK_K]: IEEE fp32
    for fp32 x, else the values cast to x's dtype (tensor cores), fp32 accumulation either way."""
    if xs.dtype == tl.float32:
        acc += tl.dot(xs, tl.trans(values), input_precision="ieee")
    else:
        acc += tl.dot(xs, tl.trans(values.to(xs.dtype)))
    return acc


@triton.jit
def store_tile(y, acc, bias, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """y[offs_m, offs_n] = acc (+ bias[offs_n]) in y's dtype, within [M, N]."""
    mask_m, mask_n = offs_m < M, offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
