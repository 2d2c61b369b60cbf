"""GGUF blocks kept quantized on CUDA: a Triton kernel that multiplies activations by Q4_0, Q4_1 or Q8_0 blocks
as the file stores them (``TritonGGMLGemm``), for ``ggml.GGMLLinearMethod`` on a GPU.

One program computes a [BLOCK_M, BLOCK_N] tile of ``y = x @ W.T``: for each block of 32 values along k it loads
the block of every one of its BLOCK_N weight rows (the fp16 scale, the offset for Q4_1, the 32 codes: bytes for
Q8_0, nibbles for the 4-bit types, value j in the low nibble of byte j and value j + 16 in its high nibble),
decodes it to the activations' dtype in registers, and accumulates its dot with x's [BLOCK_M, 32] tile in fp32
(tensor cores for bf16 / fp16; IEEE fp32 otherwise). A weight is read once per BLOCK_M rows at 4.5 to 8.5 bits a
value, where bf16 reads 16: a decode step is bound by those bytes.

The twin is ``ggml.reference_linear`` (gguf's dequantization, then ``F.linear``). Without CUDA the kernel runs
through Triton's interpreter (tests). Importing this module imports triton; only the model registry does, for
CUDA, and the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from kvserve.model.layers.ggml import GGMLTensor

Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
TRITON_TYPES = frozenset({Q4_0, Q4_1, Q8_0})
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
BLOCK_VALUES = 32


@triton.jit
def _half(ptr, mask):
    """The fp16 stored little-endian at byte pointers ``ptr``, as fp32 (0 where ``mask`` is off)."""
    bits = tl.load(ptr, mask=mask, other=0).to(tl.int16) | (tl.load(ptr + 1, mask=mask, other=0).to(tl.int16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def ggml_gemm_kernel(x, w, bias, y, M, N, K, stride_xm, stride_ym, row_bytes,
                     QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 32)
    mask_m, mask_n = offs_m < M, offs_n < N
    rows = w + offs_n.to(tl.int64) * row_bytes  # each weight row's first byte
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, K // 32):
        xs = tl.load(x + offs_m[:, None].to(tl.int64) * stride_xm + b * 32 + offs_j[None, :], mask=mask_m[:, None],
                     other=0.0)
        if QTYPE == 8:  # Q8_0: fp16 d, then 32 int8 codes; w = d * q
            block = rows + b * 34
            d = _half(block, mask_n)
            q = tl.load(block[:, None] + 2 + offs_j[None, :], mask=mask_n[:, None], other=0).to(tl.int8)
            values = d[:, None] * q.to(tl.float32)
        else:  # Q4_0 (fp16 d; w = d * (q - 8)) and Q4_1 (fp16 d and m; w = d * q + m): 16 bytes of nibbles
            block = rows + b * (18 if QTYPE == 2 else 20)
            d = _half(block, mask_n)
            byte = tl.load(block[:, None] + (2 if QTYPE == 2 else 4) + offs_j[None, :] % 16, mask=mask_n[:, None],
                           other=0).to(tl.int32)
            q = tl.where(offs_j[None, :] < 16, byte & 15, byte >> 4).to(tl.float32)
            if QTYPE == 2:
                values = d[:, None] * (q - 8.0)
            else:
                values = d[:, None] * q + _half(block + 2, mask_n)[:, None]
        if xs.dtype == tl.float32:
            acc += tl.dot(xs, tl.trans(values), input_precision="ieee")
        else:
            acc += tl.dot(xs, tl.trans(values.to(xs.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


class TritonGGMLGemm:
    """``BlockGemm`` on CUDA: ``x [M, K] @ W.T (+ bias)`` for W a ``GGMLTensor`` of a type in ``TRITON_TYPES``,
    at any number of rows (``max_rows``: no dense layout is kept beside the blocks)."""

    types = TRITON_TYPES
    max_rows = 1 << 31

    def __call__(self, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != k or weight.qtype not in TRITON_TYPES or k % BLOCK_VALUES:
            raise ValueError(f"Triton ggml GEMM: x {tuple(x.shape)} does not fit a {weight.qtype.name} weight of "
                             f"shape {weight.shape} (types {', '.join(t.name for t in TRITON_TYPES)})")
        x = x if x.stride(1) == 1 else x.contiguous()
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device) if out is None else out
        if x.shape[0]:
            block_m = 16 if x.shape[0] <= 16 else 64
            grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, 64))
            ggml_gemm_kernel[grid](x, weight.blocks, bias if bias is not None else x, y, x.shape[0], n, k, x.stride(0),
                                   y.stride(0), weight.blocks.stride(0), QTYPE=int(weight.qtype),
                                   HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=64)
        return y

    batched = __call__

    def dequantize(self, weight: GGMLTensor, out: torch.Tensor) -> torch.Tensor:
        """The fp32 values of ``weight`` into ``out`` (gguf's reference: for a layer that is not kept)."""
        return out.copy_(weight.dequantize())

    def place(self, weight: GGMLTensor, device: torch.device) -> GGMLTensor:
        """The blocks on ``device``, where the kernel reads them."""
        return GGMLTensor(weight.blocks.to(device), weight.qtype, weight.shape)
