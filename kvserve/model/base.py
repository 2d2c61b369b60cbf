"""The contract every model family implements. Models take their inputs explicitly: no global context."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.kv.quant import KVCacheDtype
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from kvserve.model.layers.lora import LoRAMapping, Projections
from kvserve.model.offload import WeightStreamer


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over paged KV.

    ``forward`` maps the step's flat token batch ([T] ids and positions) to final hidden states [T, hidden];
    ``compute_logits`` applies the LM head (fp32 logits) to the rows the runner selects. ``lora``, the step's
    tokens grouped by LoRA adapter (``layers/lora.py``), adds the adapters' terms to the projections
    (``lora_projections``) of the rows that have one; None (no row has one) runs the base model alone.
    """

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        # set where decoder layers' weights stream in from host memory as they run (``model/offload.py``): its
        # copies wait on events across streams, which no CUDA graph captures
        self.weight_streamer: WeightStreamer | None = None

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv: KVCacheStorage,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor: ...

    @abstractmethod
    def lora_projections(self) -> Projections:
        """The linear projections a LoRA adapter may target, by the base model's module names
        (``model.layers.0.self_attn.q_proj``): each one's layer and, in a packed layer, its projection."""

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

    def weight_bytes(self) -> int:
        """Bytes the loaded weights hold, in every layout a layer keeps (parameters and buffers, a GGUF's blocks,
        a mapped file's tensors, a dense or prepacked copy), each storage counted once (a tied head shares the
        embeddings')."""
        sizes: dict[int, int] = {}
        for module in self.modules():
            held = itertools.chain(vars(module).values(), module._parameters.values(), module._buffers.values())
            for tensor in (tensor for value in held for tensor in _tensors_in(value)):
                if tensor.is_mkldnn:  # oneDNN's opaque layout: its values' bytes
                    sizes[id(tensor)] = tensor.numel() * tensor.element_size()
                elif tensor.device.type != "meta":
                    storage = tensor.untyped_storage()
                    sizes[storage.data_ptr()] = storage.nbytes()
        return sum(sizes.values())

    def sliding_windows(self) -> set[int | None]:
        """The distinct attention windows of the layers (None = global attention)."""
        return set(self.layer_windows())

    @abstractmethod
    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window (None = global attention), in layer order."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or tensor and what is wrong."""


def _tensors_in(value: object) -> list[torch.Tensor]:
    """The tensors a module attribute holds: a tensor, a GGUF tensor's blocks, or those of a tuple of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple) and hasattr(value, "blocks"):  # a GGMLTensor (no import of the layers here)
        return [value.blocks]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors_in(item)]
    return []
