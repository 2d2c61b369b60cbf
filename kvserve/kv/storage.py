"""KVCacheStorage: the per-layer paged K and V tensors the attention backend reads and writes.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's flat slot is
``block_id * block_size + offset``. The scheduler never sees these tensors, only block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCacheStorage:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the step's new keys and values ([T, num_kv_heads, head_dim]) at their flat slots."""
        flat_shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        self.k_caches[layer].view(flat_shape).index_copy_(0, slot_mapping, k.to(self.spec.dtype))
        self.v_caches[layer].view(flat_shape).index_copy_(0, slot_mapping, v.to(self.spec.dtype))

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Apply (src, dst) block copies in every layer (copy-on-write of a shared partial block)."""
        if not copies:
            return
        device = self.k_caches[0].device
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
        for cache in (*self.k_caches, *self.v_caches):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @property
    def nbytes(self) -> int:
        return self.spec.bytes_per_block * self.num_blocks
