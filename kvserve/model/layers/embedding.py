"""Token embeddings whose rows may be split over tensor-parallel ranks (vocab-parallel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers.linear import copy_weight
from kvserve.model.layers.tensor_parallel import LinearShard, Shardable, TensorParallel


class VocabEmbedding(Shardable, nn.Embedding):
    """``nn.Embedding``; once ``shard``-ed, this rank holds ``ceil(vocab / size)`` rows, looks up the ids that
    fall in them (zeros for the others) and all-reduces: one collective per step."""

    tp_shard: LinearShard | None = None

    def shard(self, tp: TensorParallel) -> None:
        first, count = tp.split_vocab(self.num_embeddings)
        self.tp_shard = LinearShard(tp, 0, {None: (first, count)})
        self.weight = nn.Parameter(torch.empty(count, self.embedding_dim, dtype=self.weight.dtype),
                                   requires_grad=False)

    def load_weight(self, tensor: torch.Tensor) -> None:
        """Copy the checkpoint's [vocab, hidden] embeddings (this rank's rows of them) into ``weight``."""
        if self.tp_shard is not None:
            tensor = self.tp_shard.narrow("weight", tensor, None)
        copy_weight(self.weight, tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_shard is None:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.tp_shard.ranges[None][0]
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return self.tp_shard.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))
