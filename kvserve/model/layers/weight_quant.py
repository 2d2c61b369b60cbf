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

import torch
from gguf import GGMLQuantizationType

from kvserve.model.layers.ggml import BlockGemm, GGMLGemm, GGMLLinearMethod, GGMLTensor
from kvserve.model.layers.linear import Linear, LinearMethod

WEIGHT_ONLY_SCHEMES = ("int8", "int4")
INT4_GROUP_SIZE = 128
_BLOCK = 32  # values per ggml block


def quantize_weight(weight: torch.Tensor, scheme: str) -> GGMLTensor:
    """``weight`` [rows, k] (k a multiple of 32) in the blocks of ``scheme``."""
    rows, k = weight.shape
    if k % _BLOCK:
        raise ValueError(f"weight-only {scheme} needs rows of a multiple of {_BLOCK} values, not {k}")
    w = weight.detach().to(torch.float32).cpu()
    if scheme == "int8":
        return _q8_0_per_channel(w)
    if scheme == "int4":
        return _q4_1_groups(w, INT4_GROUP_SIZE)
    raise ValueError(f"unknown weight-only scheme {scheme!r}; expected one of {', '.join(WEIGHT_ONLY_SCHEMES)}")


def _q8_0_per_channel(w: torch.Tensor) -> GGMLTensor:
    rows, k = w.shape
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16)
    codes = torch.where(scale > 0, w / scale.float(), 0.0).round().clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([
        scale.view(torch.uint8).view(rows, 1, 2).expand(rows, k // _BLOCK, 2),
        codes.view(torch.uint8).view(rows, k // _BLOCK, _BLOCK),
    ], dim=2)  # per block: fp16 scale, 32 int8 codes
    return GGMLTensor(blocks.reshape(rows, -1).contiguous(), GGMLQuantizationType.Q8_0, (rows, k))


def _q4_1_groups(w: torch.Tensor, group_size: int) -> GGMLTensor:
    rows, k = w.shape
    blocks_per_group = torch.tensor([min(group_size, k - start) // _BLOCK for start in range(0, k, group_size)])
    groups = torch.split(w, [int(n) * _BLOCK for n in blocks_per_group], dim=1)
    low = torch.stack([g.amin(dim=1) for g in groups], dim=1).to(torch.float16)  # [rows, groups]
    high = torch.stack([g.amax(dim=1) for g in groups], dim=1)
    scale = ((high - low.float()) / 15).to(torch.float16)
    # each block of 32 takes its group's scale and minimum
    block_scale = scale.repeat_interleave(blocks_per_group, dim=1).float().unsqueeze(-1)
    block_low = low.repeat_interleave(blocks_per_group, dim=1).float().unsqueeze(-1)
    values = w.view(rows, k // _BLOCK, _BLOCK)
    codes = torch.where(block_scale > 0, (values - block_low) / block_scale, 0.0).round().clamp(0, 15)
    codes = codes.to(torch.uint8)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # ggml's order: value j and j + 16 share byte j
    params = torch.stack([block_scale.squeeze(-1).half(), block_low.squeeze(-1).half()], dim=-1)
    blocks = torch.cat([params.view(torch.uint8).view(rows, k // _BLOCK, 4), packed], dim=2)
    return GGMLTensor(blocks.reshape(rows, -1).contiguous(), GGMLQuantizationType.Q4_1, (rows, k))


class WeightOnlyLinearMethod(GGMLLinearMethod):
    """Quantizes each linear layer's weight as it loads, then runs it as the GGUF blocks are run (the block kernel
    for steps of a few tokens, the dequantized weight in the dense layout for larger ones). A tied LM head keeps
    the embeddings' weight as loaded, as vLLM leaves the head unquantized."""

    def __init__(self, kernel: GGMLGemm, dense: LinearMethod, scheme: str, gemm: BlockGemm | None = None) -> None:
        super().__init__(kernel, dense, gemm)
        self.scheme = scheme

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor | GGMLTensor, shard: str | None) -> None:
        if name == "weight":
            dense = tensor.dequantize() if isinstance(tensor, GGMLTensor) else tensor
            tensor = quantize_weight(dense, self.scheme)
        super().load_weight(layer, name, tensor, shard)
