"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

Differences from Llama: sliding and full layers interleaved by ``config.layer_types``, each type with its own
rope parameters; attention scale ``query_pre_attn_scalar ** -0.5``; per-head q/k norms; the (1 + weight)
RMSNorm in fp32, four per layer (sandwiching attention and MLP); embeddings scaled by sqrt(hidden_size)
rounded to the embedding dtype; a gelu-tanh MLP; optional final logit soft-capping.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.kv.storage import KVCacheStorage
from kvserve.model.layers.activation import GatedMLP
from kvserve.model.layers.attention import Attention
from kvserve.model.layers.lora import LoRAMapping
from kvserve.model.layers.norm import GemmaRMSNorm
from kvserve.model.llama import DecoderLM, input_norm, layer_type_window


class Gemma3DecoderLayer(nn.Module):
    """``h = x + norm(attn(norm(x)))``, then ``h + norm(mlp(norm(h)))``; ``DecoderLayer``'s contract (each
    residual add folded into the norm after it)."""

    def __init__(self, self_attn: Attention, mlp: GatedMLP, make_norm: Callable[[int], nn.Module], dim: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(dim)
        self.self_attn = self_attn
        self.post_attention_layernorm = make_norm(dim)
        self.pre_feedforward_layernorm = make_norm(dim)
        self.mlp = mlp
        self.post_feedforward_layernorm = make_norm(dim)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv: KVCacheStorage,
        lora: LoRAMapping | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        attn_out = self.self_attn(hidden, rope, attn, kv, lora)
        hidden = self.pre_feedforward_layernorm(attn_out, residual, x_norm=self.post_attention_layernorm)
        return self.post_feedforward_layernorm(self.mlp(hidden, lora)), residual


class Gemma3ForCausalLM(DecoderLM):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend) -> None:
        _check_supported(config)
        super().__init__(config, backend)
        self.embed_scale = config.hidden_size**0.5

    def _attention_biases(self) -> tuple[bool, bool]:
        return self.config.attention_bias, self.config.attention_bias

    def _qk_norm(self) -> Callable[[int], nn.Module] | None:
        return partial(GemmaRMSNorm, eps=self.config.rms_norm_eps)

    def _attention_scale(self) -> float:
        return self.config.query_pre_attn_scalar**-0.5

    def _sliding_window(self, layer_idx: int) -> int | None:
        return layer_type_window(self.config, layer_idx)

    def _rope_key(self, layer_idx: int) -> str | None:
        return self.config.layer_types[layer_idx]

    def _activation(self) -> str:
        return self.config.hidden_activation

    def _make_norm(self, dim: int) -> nn.Module:
        return GemmaRMSNorm(dim, self.config.rms_norm_eps)

    def _make_layer(self, layer_idx: int) -> nn.Module:
        return Gemma3DecoderLayer(
            self._make_attention(layer_idx), self._make_mlp(), self._make_norm, self.config.hidden_size
        )

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        return embeds * _scale_in(self.embed_scale, embeds.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _check_supported(config: PretrainedConfig) -> None:
    if config.attn_logit_softcapping is not None:
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported: the attention backends do not soft-cap")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder) is not a causal LM")


@cache
def _scale_in(scale: float, dtype: torch.dtype) -> float:
    """HF multiplies the embeddings by their scale cast to the embedding dtype (bf16 rounds sqrt(hidden_size)):
    that value, worked out once on the host (a value read in the forward would keep it from a CPU step graph)."""
    return torch.tensor(scale, dtype=dtype).item()
