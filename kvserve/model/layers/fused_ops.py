"""The elementwise ops between a decoder layer's GEMMs, behind one seam: RMSNorm (with the residual add folded in),
the per-head q / k norms and the rotary embedding of q and k, in place, and the gated MLP's activation times up.

``TorchFusedOps`` computes them with the modules' own plain-PyTorch formulas, op by op: the twin every faster
implementation is tested against, and what CUDA and non-fp32 dtypes run. ``model/registry.py`` chooses the
implementation for the device and dtype (``select_fused_ops``) and ``build_model`` binds it to every module that
calls one of these ops, as it binds a ``LinearMethod`` to every ``Linear``. The residual stream they share::

    residual = embeddings;   hidden = norm_0(residual)
    per norm after that:     residual += x (x: an attention or MLP output);   hidden = norm(residual)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.model.layers.rotary import apply_rotary

if TYPE_CHECKING:
    from kvserve.model.layers.activation import GatedMLP
    from kvserve.model.layers.norm import RMSNorm


class TorchFusedOps:
    """The ops in plain PyTorch, one op at a time: the reference twin, and the base a faster implementation falls
    back to for inputs it does not take."""

    def rms_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None, x_norm: RMSNorm | None = None
    ) -> torch.Tensor:
        """``norm(x)``; with a ``residual``, ``residual += x`` (``x_norm(x)`` when given: Gemma's sandwich norm)
        in place, then ``norm(residual)``."""
        if residual is None:
            return norm.plain(x)
        residual.add_(x if x_norm is None else x_norm.plain(x))
        return norm.plain(residual)

    def head_rms_norm_(self, norm: RMSNorm, heads: torch.Tensor) -> None:
        """Normalize each head of ``heads`` [T, num_heads, head_dim] in place by ``norm`` (the per-head q / k norms
        before RoPE)."""
        heads.copy_(norm.plain(heads))

    def rotary_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``qk`` [T, heads, head_dim] in place by the angles of ``cos`` / ``sin`` [T, 1, head_dim / 2]."""
        qk.copy_(apply_rotary(qk, cos, sin))

    def act_and_mul(self, mlp: GatedMLP, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the packed ``gate_up`` [T, 2 * intermediate] rows, with ``mlp``'s activation."""
        gate, up = gate_up.chunk(2, dim=-1)
        return mlp.act(gate) * up


class UsesFusedOps:
    """A module whose forward goes through ``self.ops``: the twin until ``build_model`` binds the implementation
    selected for the model's device and dtype."""

    ops: TorchFusedOps = TorchFusedOps()
