"""PackedLinear: several Hugging Face projections of the same input stored as one weight, so they cost one GEMM."""

from __future__ import annotations

from torch import nn


class PackedLinear(nn.Linear):
    """A Linear whose output rows are the concatenation of named Hugging Face projections.

    ``shards`` maps each HF projection name (``q_proj``) to its number of output rows, in packing order;
    ``shard_rows`` tells the weight loader where each one goes.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, size in self.shards.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows
