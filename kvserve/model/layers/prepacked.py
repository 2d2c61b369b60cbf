"""Linear layers whose weights are laid out once, at load, in oneDNN's blocked format for CPU GEMMs.

A plain ``F.linear`` on CPU packs the weight into the GEMM's panel layout on every call: at decode batch sizes
that repacking reads and writes every weight again each step, and it dominates. Measured on 2 cores (AVX-512)
at SmolLM2's shapes, one step's GEMMs over all 30 layers and the LM head:

    tokens in the step     7      16     33     64     256
    F.linear             43 ms  61 ms  72 ms  106 ms  264 ms
    prepacked            34 ms  44 ms  60 ms   92 ms  255 ms

(one token: 21 vs 27 ms, the one case it loses; batches of one are not what a server runs). This is the path
PyTorch's own CPU compiler takes for frozen fp32 linears (``torch.ops.mkldnn._linear_pointwise``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class PrepackedLinear(nn.Module):
    """``nn.Linear``'s forward over a weight reordered for oneDNN; the plain weight is not kept."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 on a CPU build of torch that has oneDNN and the op (an internal one: checked, not assumed)."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``PrepackedLinear`` of its weights; how many were replaced.
    A weight shared with another module (a tied LM head) is reordered into a copy of its own."""
    parents = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, linear in parents:
        setattr(parent, name, PrepackedLinear(linear.weight, linear.bias))
    logger.debug("prepacked %d linear layers for oneDNN", len(parents))
    return len(parents)
