"""GGUF blocks kept quantized on CUDA: a Triton kernel that multiplies activations by ggml blocks as the file
stores them (``TritonGGMLGemm``), for ``ggml.GGMLLinearMethod`` on a GPU.

It reads the blocks of 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quant super-blocks of 256 (Q4_K,
Q5_K, Q6_K): what a Q4_K_M file such as Gemma 3's holds (Q4_K and Q6_K where a row is whole super-blocks, Q5_0
and Q8_0 where it is not). One program computes a [BLOCK_M, BLOCK_N] tile of ``y = x @ W.T``. Its k loop walks
the blocks of its BLOCK_N weight rows and, inside a super-block, its groups of 32 values (a K-quant's sub-block
of 32; Q6_K's pair of sub-blocks of 16): each group's scale and offset are decoded from the block's bytes, its
32 quants unpacked, and the values built in fp32 registers and cast to the activations' dtype, then dotted with x's
[BLOCK_M, 32] tile into an fp32 accumulator (tensor cores for bf16 / fp16; IEEE fp32 otherwise). A weight is
read once per BLOCK_M rows at 4.5 to 8.5 bits a value, where bf16 reads 16: a decode step is bound by those
bytes. Each layout's decoding is one small helper below, its docstring the byte map (derived from
``gguf.quants``' dequantization and built from the same fp32 operations: gguf's values bit for bit, but where
the compiler fuses a multiply and an add, one rounding apart).

The twin is ``ggml.reference_linear`` (gguf's dequantization, then ``F.linear``). Without CUDA the kernel runs
through Triton's interpreter (tests). Importing this module imports triton; only the model registry does, for
CUDA, and the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.model.layers.ggml import GGMLTensor
from kvserve.model.layers.triton_tiles import accumulate_dot, exact_float, store_tile

Q = GGMLQuantizationType
TRITON_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
BLOCK_VALUES = {qtype: GGML_QUANT_SIZES[qtype][0] for qtype in TRITON_TYPES}  # 32, or 256 for a K-quant
BLOCK_BYTES = {qtype: GGML_QUANT_SIZES[qtype][1] for qtype in TRITON_TYPES}
GROUP_VALUES = 32  # the values the kernel decodes and dots at a time

# ggml's type ids, as the kernels' constexpr branches compare them
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _Q4_K, _Q5_K, _Q6_K = (
    tl.constexpr(int(qtype)) for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
)


@triton.jit
def _half(ptr, mask):
    """The fp16 stored little-endian at byte pointers ``ptr``, as fp32 (0 where ``mask`` is off)."""
    bits = tl.load(ptr, mask=mask, other=0).to(tl.int16) | (tl.load(ptr + 1, mask=mask, other=0).to(tl.int16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr, mask):
    """The byte at each of the pointers ``ptr``, as int32 0..255 (0 where ``mask`` is off)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _bytes(block, offs, mask):
    """Bytes ``offs`` of each row's block: int32 [rows, len(offs)], 0 where the row's ``mask`` is off."""
    return tl.load(block[:, None] + offs[None, :], mask=mask[:, None], other=0).to(tl.int32)


@triton.jit
def _block32_values(block, offs_j, mask, QTYPE: tl.constexpr):
    """A block of 32 values (value j = ``offs_j``) of each row, fp32 [rows, 32]. d and m are fp16; the
    nibbles are 16 bytes, value j the low nibble of byte j, value j + 16 its high nibble; Q5's fifth bits are
    a little-endian uint32, bit j value j's::

        Q4_0  | d | nibbles |                      w = d (q - 8)     18 bytes
        Q4_1  | d | m | nibbles |                  w = d q + m       20 bytes
        Q5_0  | d | fifth bits | nibbles |         w = d (q - 16)    22 bytes
        Q5_1  | d | m | fifth bits | nibbles |     w = d q + m       24 bytes
        Q8_0  | d | 32 int8 q |                    w = d q           34 bytes
    """
    d = _half(block, mask)[:, None]
    if QTYPE == _Q8_0:
        values = d * exact_float(_bytes(block + 2, offs_j, mask).to(tl.int8))
    else:
        has_m: tl.constexpr = QTYPE == _Q4_1 or QTYPE == _Q5_1
        is_q5: tl.constexpr = QTYPE == _Q5_0 or QTYPE == _Q5_1
        nibbles: tl.constexpr = 2 + (2 if has_m else 0) + (4 if is_q5 else 0)  # after d, m, the fifth bits
        byte = _bytes(block + nibbles, offs_j % 16, mask)
        q = tl.where(offs_j[None, :] < 16, byte & 15, byte >> 4)
        if is_q5:
            fifth = _bytes(block + nibbles - 4, offs_j // 8, mask) >> (offs_j % 8)[None, :]
            q |= (fifth & 1) << 4
        if has_m:
            values = d * exact_float(q) + _half(block + 2, mask)[:, None]
        else:
            values = d * exact_float(q - (16 if is_q5 else 8))
    return values


@triton.jit
def _k_scale_min(block, g, mask):
    """Sub-block g's 6-bit scale and minimum (int32 per row) of Q4_K / Q5_K: 12 bytes from byte 4, sc0-3 and
    m0-3 in the low 6 bits of bytes 0-3 and 4-7, sc4-7 and m4-7 as a low nibble (of bytes 8-11: sc low, m
    high) and two high bits (the top bits of bytes 0-3 for sc, 4-7 for m)::

        byte   0-3: EEAAAAAA   4-7: eeaaaaaa   8-11: eeeeEEEE      (A: sc g, a: m g; E: sc g+4, e: m g+4)

    so sub-blocks g and g + 4 (g < 4) both read bytes g, g + 4 and g + 8.
    """
    scales = block + 4 + g % 4
    low, high, packed = _byte(scales, mask), _byte(scales + 4, mask), _byte(scales + 8, mask)
    sc = tl.where(g < 4, low & 63, (packed & 15) | (low >> 6) << 4)
    m = tl.where(g < 4, high & 63, (packed >> 4) | (high >> 6) << 4)
    return sc, m


@triton.jit
def _q45_k_values(block, g, offs_j, mask, QTYPE: tl.constexpr):
    """Sub-block g (0-7) of 32 values of each row's Q4_K / Q5_K super-block, fp32 [rows, 32]::

        Q4_K  | d | dmin | scales (12) | nibbles (128) |                    w = d sc q - dmin m   144 bytes
        Q5_K  | d | dmin | scales (12) | fifth bits (32) | nibbles (128) |  as Q4_K, q 5 bits    176 bytes

    Sub-blocks 2i and 2i + 1 are the low and high nibbles of nibble bytes 32i to 32i + 31 (value j of byte j);
    Q5_K's fifth bit of value j of sub-block g is bit g of fifth-bit byte j.
    """
    sc, m = _k_scale_min(block, g, mask)
    scale = _half(block, mask) * exact_float(sc)
    offset = _half(block + 2, mask) * exact_float(m)
    nibbles = 48 if QTYPE == _Q5_K else 16
    q = (_bytes(block + nibbles + 32 * (g // 2), offs_j, mask) >> 4 * (g % 2)) & 15
    if QTYPE == _Q5_K:
        q |= ((_bytes(block + 16, offs_j, mask) >> g) & 1) << 4
    return scale[:, None] * exact_float(q) - offset[:, None]


@triton.jit
def _q6_k_values(block, g, offs_j, mask):
    """Values 32g to 32g + 31 (g 0-7: two sub-blocks of 16) of each row's Q6_K super-block, fp32 [rows, 32]::

        Q6_K  | low nibbles (128) | high 2 bits (64) | 16 int8 sc | d |    w = d sc (q - 32)   210 bytes

    Each half h of the block (g = 4h + r) owns 64 bytes of low nibbles from 64h and 32 of high bits from
    128 + 32h: its group r takes the low (r < 2) or high nibbles of bytes 32 (r % 2) to 32 (r % 2) + 31, and
    bits 2r and 2r + 1 of the high bytes; sub-block 2g + j // 16 scales value j.
    """
    low = (_bytes(block + 64 * (g // 4) + 32 * (g % 2), offs_j, mask) >> 4 * ((g % 4) // 2)) & 15
    high = (_bytes(block + 128 + 32 * (g // 4), offs_j, mask) >> 2 * (g % 4)) & 3
    q = (low | high << 4) - 32
    sc = _bytes(block + 192 + 2 * g, offs_j // 16, mask).to(tl.int8)
    return (_half(block + 208, mask)[:, None] * exact_float(sc)) * exact_float(q)


@triton.jit
def _group_values(block, g, offs_j, mask, QTYPE: tl.constexpr):
    """Group g (32 values) of each row's block at byte pointers ``block``, fp32 [rows, 32]."""
    if QTYPE == _Q6_K:
        values = _q6_k_values(block, g, offs_j, mask)
    elif QTYPE == _Q4_K or QTYPE == _Q5_K:
        values = _q45_k_values(block, g, offs_j, mask, QTYPE)
    else:
        values = _block32_values(block, offs_j, mask, QTYPE)
    return values


@triton.jit
def ggml_gemm_kernel(x, w, bias, y, M, N, K, stride_xm, stride_ym, row_bytes,
                     QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y [M, N] = x [M, K] @ W.T (+ bias) for W's rows of ``row_bytes`` bytes of blocks of ``BLOCK_BYTES`` bytes,
    ``GROUPS`` groups of 32 values each (8 for a K-quant)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 32)
    mask_m, mask_n = offs_m < M, offs_n < N
    rows = w + offs_n.to(tl.int64) * row_bytes  # each weight row's first byte
    x_rows = x + offs_m[:, None].to(tl.int64) * stride_xm + offs_j[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # one loop over the groups of 32 along k, group i % GROUPS of block i // GROUPS: a loop over the blocks
    # with the groups unrolled inside would hold a dot's buffers per group (8x the shared memory in fp32)
    for i in range(0, K // 32):
        xs = tl.load(x_rows + i * 32, mask=mask_m[:, None], other=0.0)
        values = _group_values(rows + (i // GROUPS) * BLOCK_BYTES, i % GROUPS, offs_j, mask_n, QTYPE)
        acc = accumulate_dot(acc, xs, values)
    store_tile(y, acc, bias, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


class TritonGGMLGemm:
    """``BlockGemm`` on CUDA: ``x [M, K] @ W.T (+ bias)`` for W a ``GGMLTensor`` of a type in ``TRITON_TYPES``,
    at any number of rows (``max_rows``: no dense layout is kept beside the blocks)."""

    types = TRITON_TYPES
    max_rows = 1 << 31

    def __call__(self, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != k or weight.qtype not in TRITON_TYPES:
            raise ValueError(f"Triton ggml GEMM: x {tuple(x.shape)} does not fit a {weight.qtype.name} weight of "
                             f"shape {weight.shape} (types {', '.join(t.name for t in sorted(TRITON_TYPES))})")
        block_values = BLOCK_VALUES[weight.qtype]
        if k % block_values:
            raise ValueError(f"Triton ggml GEMM: a {weight.qtype.name} row is whole blocks of {block_values} "
                             f"values; k = {k} is not a multiple of {block_values}")
        x = x if x.stride(1) == 1 else x.contiguous()
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device) if out is None else out
        if x.shape[0]:
            block_m = 16 if x.shape[0] <= 16 else 64
            grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, 64))
            ggml_gemm_kernel[grid](x, weight.blocks, bias if bias is not None else x, y, x.shape[0], n, k, x.stride(0),
                                   y.stride(0), weight.blocks.stride(0), QTYPE=int(weight.qtype),
                                   BLOCK_BYTES=BLOCK_BYTES[weight.qtype], GROUPS=block_values // GROUP_VALUES,
                                   HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=64)
        return y

    batched = __call__

    def dequantize(self, weight: GGMLTensor, out: torch.Tensor) -> torch.Tensor:
        """The fp32 values of ``weight`` into ``out`` (gguf's reference: for a layer that is not kept)."""
        return out.copy_(weight.dequantize())

    def place(self, weight: GGMLTensor, device: torch.device) -> GGMLTensor:
        """The blocks on ``device``, where the kernel reads them."""
        return GGMLTensor(weight.blocks.to(device), weight.qtype, weight.shape)
