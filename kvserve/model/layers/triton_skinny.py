"""Skinny GEMMs on CUDA: ``y = x @ W.T`` for a few rows of activations (a decode step of a few streams), where a
step is bound by reading the weights once and each product is a matrix-vector product in all but name.

Two Triton kernels, one program per ``BLOCK_N`` output columns (weight rows) walking the whole of K:

- ``skinny_sum_kernel`` (up to ``MAX_SUM_ROWS`` rows): each weight tile ``[BLOCK_N, BLOCK_K]`` is multiplied by
  the rows' ``[BLOCK_M, BLOCK_K]`` slice of x in fp32 registers and summed along K; no tensor cores, no shared
  memory, several 16-byte loads per thread in flight.
- ``skinny_dot_kernel`` (up to ``MAX_DOT_ROWS`` rows): the rows padded to a 16-row ``tl.dot`` on the tensor
  cores, the weight tiles streamed through shared memory by Triton's software pipeline (``num_stages`` deep).

Both accumulate in fp32 and round once to x's dtype. The twin is ``F.linear`` (the unquantized method): a
decode step that picks these kernels is tested against it through Triton's interpreter on CPU and natively
with ``-m gpu``. Importing this module imports triton; only the model registry does, for CUDA, and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SUM_ROWS = 4
MAX_DOT_ROWS = 16
MODEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch shape: the kernel (``dot`` or ``sum``), its tile and Triton's compile options."""

    kernel: str
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def skinny_sum_kernel(y, x, w, bias, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Program n: columns ``[n * BLOCK_N, (n + 1) * BLOCK_N)`` of every row; ``EVEN``: N and K are whole tiles
    (no masks on the weight's loads)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_ptrs = x + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN:
            wt = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        else:
            mask_k = offs_k < K - k * BLOCK_K
            wt = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc += tl.sum(xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _store(y, acc, bias, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


@triton.jit
def skinny_dot_kernel(y, x, w, bias, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                      UPCAST_DOTS: tl.constexpr):
    """As ``skinny_sum_kernel``, with the rows padded to ``BLOCK_M`` (16) for one ``tl.dot`` per weight tile.
    ``UPCAST_DOTS``: the operands go in as fp32 (Triton's interpreter multiplies bf16 operands as garbage)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_ptrs = x + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN:
            wt = tl.load(w_ptrs)
            xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        else:
            mask_k = offs_k < K - k * BLOCK_K
            wt = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if UPCAST_DOTS:
            xt, wt = xt.to(tl.float32), wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _store(y, acc, bias, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


@triton.jit
def _store(y, acc, bias, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


KERNELS = {"sum": skinny_sum_kernel, "dot": skinny_dot_kernel}


def is_interpreted() -> bool:
    """Whether the kernels run through Triton's interpreter (on CPU tensors) rather than compiled for a GPU."""
    return not isinstance(skinny_dot_kernel, triton.runtime.JITFunction)


def max_rows(config: SkinnyConfig) -> int:
    """The most activation rows one launch of ``config``'s kernel takes."""
    return MAX_DOT_ROWS if config.kernel == "dot" else MAX_SUM_ROWS


def can_multiply(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels take these operands: fp16 / bf16 alike, K-contiguous rows."""
    return (x.dtype in MODEL_DTYPES and weight.dtype == x.dtype and x.dim() == 2 and x.stride(1) == 1
            and weight.stride(1) == 1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight.T (+ bias)`` for ``M <= max_rows(config)``, into ``out`` [M, N] (its rows may be
    strided) when given."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > max_rows(config) or not can_multiply(x, weight):
        raise ValueError(f"skinny_linear takes up to {max_rows(config)} K-contiguous fp16 / bf16 rows of the "
                         f"weight's dtype; got x {x.dtype} {tuple(x.shape)}, weight {weight.dtype}")
    y = out if out is not None else torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    block_m = 16 if config.kernel == "dot" else max(1, triton.next_power_of_2(num_rows))
    even = n % config.block_n == 0 and k % config.block_k == 0
    extra = {"UPCAST_DOTS": is_interpreted()} if config.kernel == "dot" else {}
    KERNELS[config.kernel][(triton.cdiv(n, config.block_n),)](
        y, x, weight, bias if bias is not None else weight, num_rows, n, k, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN=even, num_warps=config.num_warps, num_stages=config.num_stages, **extra,
    )
    return y
