"""Weight-only quantization of any checkpoint at load (``--quantization int8|int4``), into ggml block layouts that
the block kernel (``csrc/ggml_gemm.c``) already multiplies by:

- INT8, symmetric per output channel: one scale a row (its largest magnitude / 127), stored as Q8_0 blocks of
  32 codes that all carry the row's scale;
- INT4, asymmetric in groups of 128 along the input (a shorter last group where the width is not a multiple of
  128): each group's scale ((max - min) / 15) and minimum, stored as Q4_1 blocks of 32 that share them.

Scales and minimums are rounded to fp16 (the blocks' format) before the codes are computed, so the codes are
the best for the parameters actually stored. Deterministic (round half to even), vectorised, seconds for a
model. The accuracy these give on the default model is stated in docs/benchmarks.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType

from kvserve.model.layers.ggml import BlockGemm, GGMLGemm, GGMLLinearMethod, GGMLTensor
from kvserve.model.layers.linear import Linear, LinearMethod

WEIGHT_ONLY_SCHEMES = ("int8", "int4")
INT4_GROUP_SIZE = 128
_BLOCK = 32  # values per ggml block


class QuantizedRows(NamedTuple):
    """A weight [rows, k] as codes and, per group of ``group_size`` inputs (the last group may be shorter), an fp16
    scale and offset [rows, groups]: value = code * scale + offset (offset None: 0). The parameters of a scheme,
    which each device lays out for its kernels (ggml blocks on CPU, ``triton_weight_only`` on CUDA)."""

    codes: torch.Tensor  # int8 (INT8, -127..127) or uint8 (INT4, 0..15) [rows, k]
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The fp32 values [rows, k]; each a product exact in fp32 (8-bit code, 11-bit scale), then one rounding
        when an offset is added: the values every kernel builds."""
        def per_value(params: torch.Tensor) -> torch.Tensor:
            return params.float().repeat_interleave(self.group_size, dim=1)[:, : self.codes.shape[1]]
        values = self.codes.float() * per_value(self.scale)
        return values if self.offset is None else values + per_value(self.offset)


def quantize_rows(weight: torch.Tensor, scheme: str) -> QuantizedRows:
    """``weight`` [rows, k] (k a multiple of 32) quantized by ``scheme``, on its own device (the same codes on
    any: every step is exact or correctly rounded)."""
    rows, k = weight.shape
    if k % _BLOCK:
        raise ValueError(f"weight-only {scheme} needs rows of a multiple of {_BLOCK} values, not {k}")
    w = weight.detach().to(torch.float32)
    if scheme == "int8":
        return _int8_per_channel(w)
    if scheme == "int4":
        return _int4_groups(w, INT4_GROUP_SIZE)
    raise ValueError(f"unknown weight-only scheme {scheme!r}; expected one of {', '.join(WEIGHT_ONLY_SCHEMES)}")


def _int8_per_channel(w: torch.Tensor) -> QuantizedRows:
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16)
    codes = torch.where(scale > 0, w / scale.float(), 0.0).round().clamp(-127, 127).to(torch.int8)
    return QuantizedRows(codes, scale, None, w.shape[1])


def _int4_groups(w: torch.Tensor, group_size: int) -> QuantizedRows:
    rows, k = w.shape
    groups = torch.split(w, group_size, dim=1)  # k is a multiple of 32: so is a shorter last group
    low = torch.stack([g.amin(dim=1) for g in groups], dim=1).to(torch.float16)  # [rows, groups]
    high = torch.stack([g.amax(dim=1) for g in groups], dim=1)
    scale = ((high - low.float()) / 15).to(torch.float16)
    value_scale = scale.float().repeat_interleave(group_size, dim=1)[:, :k]
    value_low = low.float().repeat_interleave(group_size, dim=1)[:, :k]
    codes = torch.where(value_scale > 0, (w - value_low) / value_scale, 0.0).round().clamp(0, 15)
    return QuantizedRows(codes.to(torch.uint8), scale, low, group_size)


def quantize_weight(weight: torch.Tensor, scheme: str) -> GGMLTensor:
    """``weight`` [rows, k] (k a multiple of 32) in the ggml blocks of ``scheme``: Q8_0 blocks of 32 codes that
    all carry their row's scale, or Q4_1 blocks of 32 that share their group's scale and minimum."""
    quantized = quantize_rows(weight.cpu(), scheme)
    rows, k = quantized.codes.shape
    blocks_per_group = quantized.group_size // _BLOCK
    block_scale = quantized.scale.repeat_interleave(blocks_per_group, dim=1)[:, : k // _BLOCK]
    codes = quantized.codes.view(rows, k // _BLOCK, _BLOCK)
    if scheme == "int8":  # per block: fp16 scale, 32 int8 codes
        params = block_scale.unsqueeze(-1)
        packed = codes.view(torch.uint8)
        qtype = GGMLQuantizationType.Q8_0
    else:  # per block: fp16 scale and minimum, then byte j holding values j and j + 16 (ggml's order)
        block_low = quantized.offset.repeat_interleave(blocks_per_group, dim=1)[:, : k // _BLOCK]
        params = torch.stack([block_scale, block_low], dim=-1)
        packed = codes[..., :16] | (codes[..., 16:] << 4)
        qtype = GGMLQuantizationType.Q4_1
    blocks = torch.cat([params.contiguous().view(torch.uint8).view(rows, k // _BLOCK, -1), packed], dim=2)
    return GGMLTensor(blocks.reshape(rows, -1).contiguous(), qtype, (rows, k))


class PackedWeight(NamedTuple):
    """A weight [N, K] as the CUDA kernels read it (``triton_weight_only``, ``triton_skinny``): ``codes`` int8
    [N, K] (INT8) or uint8 [N, K / 2] (INT4, two per byte), ``scale`` and ``offset`` (or None) fp16 [N, groups]:
    the codes of ``quantize_rows``, each parameter a matrix of its own, so that a program's loads of a tile of
    rows are wide and contiguous (ggml's blocks put each scale beside its 32 codes)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.in_features

    @property
    def int4(self) -> bool:
        return self.codes.dtype == torch.uint8

    @staticmethod
    def of(quantized: QuantizedRows) -> PackedWeight:
        codes = quantized.codes
        if codes.dtype == torch.uint8:  # INT4: value 2j in the low nibble of byte j, 2j + 1 in the high
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        return PackedWeight(codes.contiguous(), quantized.scale.contiguous(),
                            None if quantized.offset is None else quantized.offset.contiguous(),
                            quantized.group_size, quantized.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The fp32 values [N, K] the kernel builds."""
        codes = self.codes
        if self.int4:
            codes = torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1)
        return QuantizedRows(codes, self.scale, self.offset, self.group_size).dequantize()


class WeightOnlyLinearMethod(GGMLLinearMethod):
    """Quantizes each linear layer's weight as it loads, then runs it as the GGUF blocks are run (the block kernel
    for steps of a few tokens; for larger ones the dequantized weight in the dense layout, or with ``keep_dense``
    off, ``gemm.batched`` on the blocks). A tied LM head keeps the embeddings' weight as loaded, as vLLM leaves the
    head unquantized."""

    def __init__(self, kernel: GGMLGemm, dense: LinearMethod, scheme: str, gemm: BlockGemm | None = None,
                 keep_dense: bool = True) -> None:
        super().__init__(kernel, dense, gemm, keep_dense)
        self.scheme = scheme

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor | GGMLTensor, shard: str | None) -> None:
        if name == "weight":
            dense = tensor.dequantize() if isinstance(tensor, GGMLTensor) else tensor
            tensor = quantize_weight(dense, self.scheme)
        super().load_weight(layer, name, tensor, shard)
