"""Activation functions by their Hugging Face config names, and the gated MLP built on them."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers.fused_ops import UsesFusedOps
from kvserve.model.layers.linear import Linear, PackedLinear
from kvserve.model.layers.lora import LoRAMapping
from kvserve.model.layers.tensor_parallel import Shardable, TensorParallel, column_parallel, row_parallel

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}
# the activations the C and Triton kernels compute, by config name -> the kernels' enum: SiLU, GELU's tanh form
KERNEL_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class GatedMLP(UsesFusedOps, Shardable, nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up packed into one GEMM; ``activation`` is the config's name."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool) -> None:
        super().__init__()
        shards = {"gate_proj": intermediate_size, "up_proj": intermediate_size}
        self.gate_up_proj = PackedLinear(hidden_size, shards, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.activation, self.act = activation, get_activation(activation)

    def shard(self, tp: TensorParallel) -> None:
        """gate and up column-parallel, down row-parallel: one all-reduce per MLP block."""
        columns = tp.split(self.down_proj.in_features, "intermediate (MLP) features")
        column_parallel(self.gate_up_proj, tp, {"gate_proj": columns, "up_proj": columns})
        row_parallel(self.down_proj, tp, columns)

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if lora is None or not lora.touches(self.down_proj):
            return self.down_proj.forward_gated(gate_up, self.activation, self._act_and_mul)
        # the LoRA term of down needs its input, which a method's gated kernel never writes out: the product
        # is made apart for a step whose adapters target down
        return self.down_proj(self._act_and_mul(gate_up), lora)

    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.act_and_mul(self, gate_up)
