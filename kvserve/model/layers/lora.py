"""LoRA terms on the linear layers: each layer keeps the adapters' weights installed on it (``Linear.lora``), and a
step's ``LoRAMapping``, passed into the model's forward, says which of the step's token rows use which adapter.

A layer's output for the rows of adapter i gains ``(x @ A_i.T) @ B_i.T``: two skinny GEMMs per adapter present in
the step (rows grouped by adapter, gathered and scattered back), in plain PyTorch after whatever method computed
the base output, so every weight format (dense, prepacked, mapped, GGUF blocks, int8 / int4, fp8) takes it alike.
A packed layer (q/k/v, gate/up) holds one (A, B) pair per adapter: the targeted projections' A matrices stacked,
and their B matrices placed in a block-diagonal B over the packed output rows, so its term is two GEMMs too.
The scale (``lora_alpha / r``) is folded into B as it is installed.

A step of few tokens over several adapters (decodes: ``MASKED_MAX_TOKENS``) takes every adapter's term in one GEMM
pair instead: the adapters' A stacked [sum r, in] (kept on the layer for the step's set of adapters), every row
multiplied by all of them, the columns of the adapters a row does not use zeroed by a mask made once a step, then
the stacked B. The grouped path cost four small ops per adapter and projection, which a decode step's few rows
left launch-bound (16 streams over 4 adapters: 0.57x the base model's tok/s); the masked one costs three however
many adapters, for (adapters - 1) times the grouped path's LoRA FLOPs, small beside the base GEMM at a decode's
row count, so a larger step keeps the grouped path.

Under tensor parallelism each rank installs its part of an adapter, cut once as it is installed
(``LinearShard.narrow_lora``): on a column-parallel layer (q/k/v, gate/up) A whole and the rows of B of its output
shard, each projection's of a packed layer; on a row-parallel one (o, down) the columns of A of its input shard and
B whole, whose partial term the layer's all-reduce sums with the base output's. No step adds a collective.

A CPU step graph (``worker/cpu_graph.py``) records a decode step with adapters on the masked path whatever their
number, over its own static tensor of each token's group (``with_token_groups``): a replay loads the step's
groups into it (``token_group_ids``), and recomputes the mask from it, the stacked weights fixed for the set of
adapters the graph was recorded for.

A fused kernel would go in ``LoRAMapping.add``: punica's SGMV / BGMV (S-LoRA, vLLM, SGLang) read each token's
adapter index and stacked weights in one launch for every adapter of the step, with no gather, scatter or mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.device_copy import to_device

if TYPE_CHECKING:
    from kvserve.model.layers.linear import Linear
    from kvserve.model.lora_adapter import LoRAAdapter

# the base model's module name of a projection -> its layer and, in a packed layer, its projection's name
Projections = dict[str, tuple["Linear", str | None]]
# the most tokens a step over several adapters takes the masked path with (the module's docstring)
MASKED_MAX_TOKENS = 256
# the stacked A and B a layer keeps, for the last few sets of adapters its steps had (each a copy of their weights)
STACKS_KEPT = 4


@dataclass(frozen=True)
class LoRAGroup:
    """The step's token rows that run with adapter ``adapter_id``; ``rows`` None: every row of the step."""

    adapter_id: int
    rows: torch.Tensor | None  # int64 [n], on the model's device


@dataclass(frozen=True)
class LoRAMapping:
    """A step's tokens grouped by adapter (rows of the base model alone are in no group); None in place of a
    mapping: no row of the step has an adapter. ``token_groups`` (the masked path): each token's group index, -1
    for the base model's."""

    groups: tuple[LoRAGroup, ...]
    token_groups: torch.Tensor | None = None  # int64 [T], on the model's device
    _masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of_tokens(cls, adapter_of_token: np.ndarray, device: torch.device) -> LoRAMapping | None:
        """The mapping of a step whose token t runs with adapter ``adapter_of_token[t]`` (0: the base model's)."""
        adapter_ids = np.unique(adapter_of_token[adapter_of_token != 0])
        if not len(adapter_ids):
            return None
        if len(adapter_ids) > 1 and len(adapter_of_token) <= MASKED_MAX_TOKENS:
            token_groups = np.searchsorted(adapter_ids, adapter_of_token)
            token_groups[adapter_of_token == 0] = -1
            return cls(tuple(LoRAGroup(int(i), None) for i in adapter_ids), to_device(token_groups, torch.int64,
                                                                                       device))
        groups = []
        for adapter_id in adapter_ids.tolist():
            token_rows = np.flatnonzero(adapter_of_token == adapter_id)
            every_row = len(token_rows) == len(adapter_of_token)  # no gather and scatter for a step of one adapter
            groups.append(LoRAGroup(adapter_id, None if every_row else to_device(token_rows, torch.int64, device)))
        return cls(tuple(groups))

    @property
    def adapter_ids(self) -> tuple[int, ...]:
        """The step's adapters, in group order."""
        return tuple(group.adapter_id for group in self.groups)

    def token_group_ids(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """Each of the step's ``num_tokens`` tokens' group index, -1 for the base model's (int64 [T]): the masked
        path's ``token_groups``, made from the groups' rows where the step took the grouped path."""
        if self.token_groups is not None:
            return self.token_groups
        ids = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        for index, group in enumerate(self.groups):
            ids[slice(None) if group.rows is None else group.rows] = index
        return ids

    def with_token_groups(self, token_groups: torch.Tensor) -> LoRAMapping:
        """The same adapters on the masked path, each token's group read from ``token_groups`` (a step graph's
        static tensor, loaded with ``token_group_ids`` before each replay)."""
        return LoRAMapping(tuple(LoRAGroup(adapter_id, None) for adapter_id in self.adapter_ids), token_groups)

    def add(self, layer: Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the layer's output for ``x`` [T, in], [T, out]) with each group's LoRA term added in place."""
        if self.token_groups is not None:
            return self._add_masked(layer, x, y)
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

    def _add_masked(self, layer: Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        stack = _stack(layer, tuple(group.adapter_id for group in self.groups))
        if stack is None:  # no adapter of the step touches this layer
            return y
        a, b, column_groups = stack
        terms = x @ a.T  # [T, sum r]: every row through every adapter's A
        terms.mul_(self._mask(column_groups, terms.dtype))
        return y.addmm_(terms, b.T)

    def _mask(self, column_groups: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """[T, sum r]: 1 where a column's adapter is its row's (made once a step for each layout of columns)."""
        mask = self._masks.get(column_groups)
        if mask is None:
            assert self.token_groups is not None
            columns = torch.tensor(column_groups, dtype=torch.int64, device=self.token_groups.device)
            mask = self._masks[column_groups] = (self.token_groups[:, None] == columns[None, :]).to(dtype)
        return mask


def install_adapter(projections: Projections, adapter_id: int, adapter: LoRAAdapter,
                    dtype: torch.dtype, device: torch.device) -> None:
    """Put ``adapter``'s weights on the layers of ``projections`` under ``adapter_id`` (the model's dtype and
    device, the scale folded into B; under tensor parallelism this rank's part of them, ``LinearShard.narrow_lora``),
    in place of any the id had; ``LoRAAdapterError`` naming the adapter and module
    where one is not a projection of the model or its shapes are not the module's, before any layer is changed."""
    from kvserve.model.lora_adapter import LoRAAdapterError

    by_layer: dict[Linear, dict[str | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, (a, b) in adapter.weights.items():
        if module not in projections:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: the model has no projection {module} "
                                   f"({len(projections)} projections in its decoder layers)")
        layer, shard = projections[module]
        in_features, out_features = layer.whole_shape(shard)
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: {module}'s lora_A {list(a.shape)} and lora_B "
                                   f"{list(b.shape)} do not fit the model's {module} ({in_features} in, "
                                   f"{out_features} out)")
        if layer.tp_shard is not None:
            a, b = layer.tp_shard.narrow_lora(a, b, shard)
        by_layer.setdefault(layer, {})[shard] = (a, b * adapter.scale)
    # every copy made before any layer changes: one that fails (out of memory) leaves no part of the adapter behind
    placed = {layer: tuple(t.to(device, dtype).contiguous() for t in _packed(layer, parts))
              for layer, parts in by_layer.items()}
    remove_adapter(projections, adapter_id)  # the id's former weights, on layers the new adapter leaves alone too
    for layer, (a, b) in placed.items():
        layer.lora[adapter_id] = (a, b)


def remove_adapter(projections: Projections, adapter_id: int) -> None:
    """Take adapter ``adapter_id``'s weights off every layer."""
    for layer, _ in projections.values():
        layer.lora.pop(adapter_id, None)
        layer.lora_stacks.clear()


def _stack(layer: Linear, adapter_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None:
    """The A and B of the step's adapters on ``layer`` stacked ([sum r, in], [out, sum r]), and each column's group
    (its adapter's index in ``adapter_ids``); kept on the layer for its last ``STACKS_KEPT`` sets of adapters (a
    set lasts as long as its requests run: many steps), so copies of up to ``STACKS_KEPT * max_loras`` adapters'
    weights beside theirs, until an install or removal drops them."""
    stacks = layer.lora_stacks
    if adapter_ids in stacks:
        stacks[adapter_ids] = stacks.pop(adapter_ids)  # the most recently used last
        return stacks[adapter_ids]
    present = [(group, layer.lora[adapter_id]) for group, adapter_id in enumerate(adapter_ids)
               if adapter_id in layer.lora]
    stack = None
    if present:
        column_groups = tuple(group for group, (a, _) in present for _ in range(a.shape[0]))
        stack = (torch.cat([a for _, (a, _) in present]), torch.cat([b for _, (_, b) in present], dim=1),
                 column_groups)
    if len(stacks) >= STACKS_KEPT:
        del stacks[next(iter(stacks))]
    stacks[adapter_ids] = stack
    return stack


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
