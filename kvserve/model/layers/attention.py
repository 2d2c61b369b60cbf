"""The attention layer of a decoder: packed q/k/v projection, optional per-head q/k norm, RoPE (by the fused ops,
or by the backend as it stores the keys where it can), paged attention through the backend, output projection."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.kv.storage import KVCacheStorage
from kvserve.model.layers.fused_ops import UsesFusedOps
from kvserve.model.layers.linear import Linear, PackedLinear
from kvserve.model.layers.lora import LoRAMapping
from kvserve.model.layers.tensor_parallel import Shardable, TensorParallel, column_parallel, row_parallel


class Attention(UsesFusedOps, Shardable, nn.Module):
    """Self-attention of one layer over the step's flat token batch.

    ``qk_norm`` builds the per-head norm that Qwen3 and Gemma 3 apply to q and k before RoPE (None: no norm).
    Under tensor parallelism ``num_heads`` / ``num_kv_heads`` count this rank's heads.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        backend: AttentionBackend,
        scale: float,
        sliding_window: int | None,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.backend = backend
        self.scale = scale
        self.sliding_window = sliding_window
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = PackedLinear(hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, qkv_bias)
        self.o_proj = Linear(q_size, hidden_size, bias=o_bias)
        self.q_norm = qk_norm(head_dim) if qk_norm else None
        self.k_norm = qk_norm(head_dim) if qk_norm else None

    def shard(self, tp: TensorParallel) -> None:
        """Query heads split evenly, KV heads split or replicated (``split_kv_heads``); q/k/v column-parallel by
        heads, o row-parallel: one all-reduce per attention block."""
        first_q, self.num_heads = tp.split(self.num_heads, "attention heads")
        first_kv, self.num_kv_heads = tp.split_kv_heads(self.num_kv_heads)
        d = self.head_dim
        q_rows, kv_rows = (first_q * d, self.num_heads * d), (first_kv * d, self.num_kv_heads * d)
        column_parallel(self.qkv_proj, tp, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows})
        row_parallel(self.o_proj, tp, q_rows)  # its input columns are this rank's query heads' outputs

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv: KVCacheStorage,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, num_kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        heads = self.qkv_proj(hidden, lora).view(num_tokens, -1, self.head_dim)
        qk = heads[:, : num_heads + num_kv_heads]  # q and k together, so RoPE runs once for both, in place
        q, k, v = heads.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
        if self.q_norm is not None:  # in place, as RoPE after it
            self.ops.head_rms_norm_(self.q_norm, q)
            self.ops.head_rms_norm_(self.k_norm, k)
        backend_rotates = self.backend.takes_rope(kv, self.layer_idx)  # as it stores k: one launch fewer
        if not backend_rotates:
            self.ops.rotary_(qk, *rope)
        out = self.backend.forward(
            q, k, v, self.layer_idx, kv, attn.for_layer(self.layer_idx), scale=self.scale,
            sliding_window=self.sliding_window, rope=rope if backend_rotates else None,
        )
        return self.o_proj(out.reshape(num_tokens, -1), lora)
