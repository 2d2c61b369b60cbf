"""RMS norms in the two conventions Hugging Face models use, with the residual add of a pre-norm block folded in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers.fused_ops import UsesFusedOps


class RMSNorm(UsesFusedOps, nn.Module):
    """Llama's RMSNorm: ``weight * x / rms(x)`` (F.rms_norm matches HF's formula bit for bit in fp32).

    ``weight_offset`` is what a fused kernel adds to the weight (Gemma's convention stores ``weight - 1``).
    """

    weight_offset = 0.0

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, x_norm: RMSNorm | None = None
    ) -> torch.Tensor:
        """``norm(x)``; with a ``residual``, adds ``x`` (``x_norm(x)`` when given) to it in place and returns
        ``norm(residual)``."""
        return self.ops.rms_norm(self, x, residual, x_norm)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in plain PyTorch, as Hugging Face computes it."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, computed in fp32 whatever the model dtype, as HF does."""

    weight_offset = 1.0

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), self.weight.shape, scale, self.eps).type_as(x)
