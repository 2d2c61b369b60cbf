"""The contract every model family implements. Models take their inputs explicitly: no global context."""

from __future__ import annotations

from abc import abstractmethod
from typing import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.kv.quant import KVCacheDtype
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage


class CausalLM(nn.Module):
    """A decoder-only LM over paged KV.

    ``forward`` maps the step's flat token batch ([T] ids and positions) to final hidden states [T, hidden];
    ``compute_logits`` applies the LM head (fp32 logits) to the rows the runner selects.
    """

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv: KVCacheStorage
    ) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def tie_weights(self) -> None:
        """Make parameters that the checkpoint stores once (a tied LM head) one tensor again; ``build_model``
        calls it after moving the parameters to their device, which unties them."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters (fusing q/k/v and gate/up as the model packs
        them), a linear layer's through its ``LinearMethod``. Raises ``CheckpointError`` naming any missing,
        unexpected-shaped or absent tensor."""

    @property
    @abstractmethod
    def num_kv_heads(self) -> int: ...

    @property
    @abstractmethod
    def head_dim(self) -> int: ...

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype, kv_dtype: KVCacheDtype) -> KVCacheSpec:
        """The shape of this model's paged KV (its layers, KV heads and head size) in blocks of ``block_size``."""
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, block_size, dtype, kv_dtype)

    @abstractmethod
    def sliding_windows(self) -> set[int | None]:
        """The distinct attention windows of the layers (None = global attention)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or tensor and what is wrong."""
