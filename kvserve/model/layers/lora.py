"""LoRA terms on the linear layers: each layer keeps the adapters' weights installed on it (``Linear.lora``), and a
step's ``LoRAMapping``, passed into the model's forward, says which of the step's token rows use which adapter.

A layer's output for the rows of adapter i gains ``(x @ A_i.T) @ B_i.T``: two skinny GEMMs per adapter present in
the step (rows grouped by adapter, gathered and scattered back), in plain PyTorch after whatever method computed
the base output, so every weight format (dense, prepacked, mapped, GGUF blocks, int8 / int4, fp8) takes it alike.
A packed layer (q/k/v, gate/up) holds one (A, B) pair per adapter: the targeted projections' A matrices stacked,
and their B matrices placed in a block-diagonal B over the packed output rows, so its term is two GEMMs too.
The scale (``lora_alpha / r``) is folded into B as it is installed.

A fused kernel would go in ``LoRAMapping.add``: punica's SGMV / BGMV (S-LoRA, vLLM, SGLang) read each token's
adapter index and stacked weights in one launch for every adapter of the step, with no gather or scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.model.layers.linear import Linear
    from kvserve.model.lora_adapter import LoRAAdapter

# the base model's module name of a projection -> its layer and, in a packed layer, its projection's name
Projections = dict[str, tuple["Linear", str | None]]


@dataclass(frozen=True)
class LoRAGroup:
    """The step's token rows that run with adapter ``adapter_id``; ``rows`` None: every row of the step."""

    adapter_id: int
    rows: torch.Tensor | None  # int64 [n], on the model's device


@dataclass(frozen=True)
class LoRAMapping:
    """A step's tokens grouped by adapter (rows of the base model alone are in no group); None in place of a
    mapping: no row of the step has an adapter."""

    groups: tuple[LoRAGroup, ...]

    def add(self, layer: Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the layer's output for ``x`` [T, in], [T, out]) with each group's LoRA term added in place."""
        for group in self.groups:
            weights = layer.lora.get(group.adapter_id)
            if weights is None:  # the adapter leaves this layer alone
                continue
            a, b = weights
            if group.rows is None:
                y.addmm_(x @ a.T, b.T)
            else:
                y.index_add_(0, group.rows, (x[group.rows] @ a.T) @ b.T)
        return y

    def touches(self, layer: Linear) -> bool:
        """Whether an adapter of the step has weights on ``layer``."""
        return any(group.adapter_id in layer.lora for group in self.groups)


def install_adapter(projections: Projections, adapter_id: int, adapter: LoRAAdapter,
                    dtype: torch.dtype, device: torch.device) -> None:
    """Put ``adapter``'s weights on the layers of ``projections`` under ``adapter_id`` (the model's dtype and
    device, the scale folded into B); ``LoRAAdapterError`` naming the adapter and module where one is not a
    projection of the model or its shapes are not the module's, before any layer is changed."""
    from kvserve.model.lora_adapter import LoRAAdapterError

    by_layer: dict[Linear, dict[str | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, (a, b) in adapter.weights.items():
        if module not in projections:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: the model has no projection {module} "
                                   f"({len(projections)} projections in its decoder layers)")
        layer, shard = projections[module]
        out_rows = layer.shard_rows()[shard].stop - layer.shard_rows()[shard].start if shard else layer.out_features
        if a.shape[1] != layer.in_features or b.shape[0] != out_rows:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: {module}'s lora_A {list(a.shape)} and lora_B "
                                   f"{list(b.shape)} do not fit the model's {module} ({layer.in_features} in, "
                                   f"{out_rows} out)")
        by_layer.setdefault(layer, {})[shard] = (a, b * adapter.scale)
    for layer, parts in by_layer.items():
        a, b = _packed(layer, parts)
        layer.lora[adapter_id] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())


def remove_adapter(projections: Projections, adapter_id: int) -> None:
    """Take adapter ``adapter_id``'s weights off every layer."""
    for layer, _ in projections.values():
        layer.lora.pop(adapter_id, None)


def _packed(layer: Linear, parts: dict[str | None, tuple[torch.Tensor, torch.Tensor]]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) for the layer: a plain layer's own; a packed layer's A matrices stacked [sum r, in] and B
    [out, sum r] block-diagonal over the projections' output rows (zero rows for a projection not targeted)."""
    if None in parts:
        return parts[None]
    rows = layer.shard_rows()
    shards = [shard for shard in rows if shard in parts]
    a = torch.cat([parts[shard][0] for shard in shards]).float()
    b = torch.zeros(layer.out_features, a.shape[0])
    start = 0
    for shard in shards:
        part_b = parts[shard][1]
        b[rows[shard], start : start + part_b.shape[1]] = part_b.float()
        start += part_b.shape[1]
    return a, b
