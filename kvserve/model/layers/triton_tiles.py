"""What the Triton GEMMs over quantized weights (``triton_ggml``, ``triton_weight_only``) share: integer codes to
fp32 without a conversion instruction, a tile's product with weight values built in fp32 registers, and the
tile's epilogue."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def exact_float(q):
    """Integer codes -128..255 as fp32, by their bits: 2^23 + 128 + q is an fp32 whose low mantissa bits are
    q + 128, and subtracting 2^23 + 128 is exact. The programming guide's throughput table lists 16 type
    conversions a clock per multiprocessor on compute capability 9.0, against 64 integer and 128 fp32 operations,
    and a decode step converts every code it reads (``benchmarks/triton_weight_only.py`` and ``triton_ggml.py``
    measure the kernels)."""
    return ((q.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


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
