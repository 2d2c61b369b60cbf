"""Tensor parallelism inside the layers: which slice of each checkpoint tensor a rank holds, and the collectives
that put the slices' results back together. The model files stay rank-blind: ``build_model`` calls ``shard`` on
the modules that know how to split themselves (attention, MLP, embeddings) and on the LM head.

    column-parallel   y_r = x @ W[rows_r].T            the outputs stay split (q/k/v by heads, gate/up by columns)
    row-parallel      y = sum_r x_r @ W[:, cols_r].T   one all-reduce (o_proj: per attention block, down_proj:
                                                       per MLP block); the bias is added once, by rank 0
    vocab-parallel    embeddings: each rank looks up the ids in its rows, zeros elsewhere, one all-reduce;
                      LM head: column-parallel over the vocabulary, its logits gathered to rank 0 (which alone
                      samples; other ranks get their own slice back)

The vocabulary is split in ``ceil(vocab / size)`` rows per rank, the last rank's padded with zero rows; KV heads
are split like the query heads, or replicated when there are fewer KV heads than ranks (each rank then holds
the one KV head its query heads read). The process group is made by ``kvserve/worker/parallel.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers.linear import Linear, PackedLinear


class Shardable(ABC):
    """A module that splits itself over the ranks: ``build_model`` calls ``shard`` on the meta-device model, before
    its linear layers create their parameters."""

    @abstractmethod
    def shard(self, tp: TensorParallel) -> None:
        """Keep this rank's part: set the shapes of the layers and their ``tp_shard`` (ShardingError if the
        module's shape does not split over ``tp.size`` ranks)."""


class ShardingError(ValueError):
    """A model shape that does not split over the tensor-parallel ranks (e.g. heads not divisible)."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among ``size`` ranks and the process group their collectives run on (None alone).
    The collectives block until every rank joins, or raise after the group's timeout."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (gloo on CPU, NCCL on CUDA)

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(first, count) of this rank's even share of ``total`` ``what``; ShardingError if it does not divide."""
        if total % self.size:
            raise ShardingError(f"tensor_parallel_size={self.size} does not divide the model's {total} {what}")
        count = total // self.size
        return self.rank * count, count

    def split_kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's KV heads: an even share, or the one KV head its query heads read when
        there are fewer KV heads than ranks (then ``size`` must be a multiple of ``num_kv_heads``)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "KV heads")
        if self.size % num_kv_heads:
            raise ShardingError(f"tensor_parallel_size={self.size} is neither a divisor nor a multiple of the "
                                f"model's {num_kv_heads} KV heads")
        return self.rank * num_kv_heads // self.size, 1

    def split_vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first, padded count) of this rank's vocabulary rows: ``ceil(vocab / size)`` each."""
        count = -(-vocab_size // self.size)
        return self.rank * count, count

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        self.group.allreduce([x]).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's ``x`` concatenated along the last dimension; other ranks: their own ``x``."""
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank:
            self.group.gather([], [x.contiguous()], options).wait()
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.gather([parts], [x.contiguous()], options).wait()
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class LinearShard:
    """How a ``Linear`` is split: the checkpoint range each of its tensors loads (output rows per packed
    projection for ``dim`` 0, input columns for ``dim`` 1) and what joins the ranks' outputs."""

    tp: TensorParallel
    dim: int
    ranges: dict[str | None, tuple[int, int]]  # projection (None: the whole layer) -> (first, count)
    reduce: bool = False  # row-parallel: all-reduce the partial sums
    gathered_features: int | None = None  # LM head: rank 0 gathers the vocabulary slices, cut to this many
    # projection -> (in, out) of its whole weight, as the checkpoint and a LoRA adapter hold it
    whole_shapes: dict[str | None, tuple[int, int]] = field(default_factory=dict)

    def narrow(self, tensor: torch.Tensor, projection: str | None) -> torch.Tensor:
        """This rank's slice of a checkpoint weight or bias (of one ``projection`` of a packed layer, None: the
        whole layer), zero-padded past its end."""
        if self.dim == 1 and tensor.dim() == 1:  # a row-parallel bias: added once, by rank 0
            return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
        first, count = self.ranges[projection]
        dim = min(self.dim, tensor.dim() - 1)
        part = tensor.narrow(dim, first, max(0, min(count, tensor.shape[dim] - first)))
        missing = count - part.shape[dim]
        return F.pad(part, [0, 0] * (tensor.dim() - 1 - dim) + [0, missing]) if missing else part

    def narrow_lora(self, a: torch.Tensor, b: torch.Tensor, projection: str | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA pair of ``projection`` (A [r, in], B [out, r], whole). Column-parallel: A whole
        and the rows of B this rank's outputs are, so the term lands on its output columns. Row-parallel: the columns
        of A its input holds and B whole, so its term is a partial sum that the layer's all-reduce adds up with the
        base output's (the term is added before ``join``: after it, it would be counted once per rank)."""
        if self.dim == 0:
            return a, self.narrow(b, projection)
        return self.narrow(a, projection), b

    def join(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's ``y``: summed over the ranks, gathered to rank 0, or as is."""
        if self.reduce:
            return self.tp.all_reduce(y)
        if self.gathered_features is None:
            return y
        gathered = self.tp.gather_last_dim(y)
        return gathered[..., : self.gathered_features].contiguous() if self.tp.rank == 0 else gathered


def column_parallel(layer: Linear, tp: TensorParallel, ranges: dict[str | None, tuple[int, int]],
                    gathered_features: int | None = None) -> None:
    """Make ``layer`` (parameters not yet created) column-parallel: it holds the output rows ``ranges`` of each of
    its projections (the rows of ``W``, so its outputs stay split over the ranks)."""
    whole_shapes = {projection: layer.whole_shape(projection) for projection in ranges}
    if isinstance(layer, PackedLinear):
        layer.shards = {name: ranges[name][1] for name in layer.shards}
    layer.out_features = sum(count for _, count in ranges.values())
    layer.tp_shard = LinearShard(tp, 0, ranges, gathered_features=gathered_features, whole_shapes=whole_shapes)


def row_parallel(layer: Linear, tp: TensorParallel, columns: tuple[int, int]) -> None:
    """Make ``layer`` (parameters not yet created) row-parallel: it holds the input columns ``columns`` (the
    columns of ``W``: its input arrives split) and all-reduces its output."""
    whole_shapes = {None: layer.whole_shape(None)}
    layer.in_features = columns[1]
    layer.tp_shard = LinearShard(tp, 1, {None: columns}, reduce=True, whole_shapes=whole_shapes)


def shard_vocab_head(layer: Linear, tp: TensorParallel) -> None:
    """The LM head: this rank's vocabulary rows, logits gathered to rank 0 and cut back to the vocabulary."""
    column_parallel(layer, tp, {None: tp.split_vocab(layer.out_features)}, gathered_features=layer.out_features)


def shard_model(model: nn.Module, head: Linear | None, tp: TensorParallel) -> None:
    """Split every ``Shardable`` module of ``model`` and its LM ``head`` over ``tp``'s ranks. Layers of no
    shardable module stay whole on every rank."""
    for module in model.modules():
        if isinstance(module, Shardable):
            module.shard(tp)
    if head is not None:
        shard_vocab_head(head, tp)
