"""Llama (2, 3, 3.1+ rope scaling; SmolLM2 is this architecture), and ``DecoderLM``, the skeleton every family
in this package shares: embeddings, pre-norm decoder layers, final norm, LM head.

A family varies the skeleton through ``DecoderLM``'s hooks (biases, q/k norm, attention scale, sliding
windows, rope per layer, norm and layer classes). Parameters mirror Hugging Face names without the
``model.`` prefix, except that q/k/v and gate/up are packed (``qkv_proj``, ``gate_up_proj``): fewer,
larger GEMMs.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from kvserve.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.kv.storage import KVCacheStorage
from kvserve.model.base import CausalLM, CheckpointError
from kvserve.model.layers.activation import GatedMLP
from kvserve.model.layers.attention import Attention
from kvserve.model.layers.embedding import VocabEmbedding
from kvserve.model.layers.linear import Linear, PackedLinear, WeightShapeError, copy_weight
from kvserve.model.layers.lora import LoRAMapping, Projections
from kvserve.model.layers.norm import RMSNorm
from kvserve.model.layers.rotary import RotaryEmbedding, rope_head_dim

WeightLoaders = dict[str, Callable[[torch.Tensor], None]]


def layer_type_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The window of a layer under ``config.layer_types`` (HF's per-layer "sliding_attention"/"full_attention")."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or layer_types[layer_idx] != "sliding_attention":
        return None
    return config.sliding_window


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``, then ``h + mlp(norm(h))``, each residual add folded into the
    norm after it (the next layer's input norm, or the final norm, adds this layer's MLP output)."""

    def __init__(self, self_attn: Attention, mlp: GatedMLP, make_norm: Callable[[int], nn.Module], dim: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(dim)
        self.self_attn = self_attn
        self.post_attention_layernorm = make_norm(dim)
        self.mlp = mlp

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv: KVCacheStorage,
        lora: LoRAMapping | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``: the previous layer's output, still to be added to the ``residual`` stream (before the
        first layer, the embeddings and no residual). Returns this layer's output and the residual stream,
        which it updates in place."""
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, attn, kv, lora), residual)
        return self.mlp(hidden, lora), residual


def input_norm(
    norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's first norm and the residual stream: the embeddings themselves before the first layer."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual), residual


class DecoderLM(CausalLM):
    """Embeddings, decoder layers, final norm and LM head (tied to the embeddings when the config says so)."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self._head_dim = rope_head_dim(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self._make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = self._make_norm(config.hidden_size)
        self.tied = getattr(config, "tie_word_embeddings", False)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope_keys = [self._rope_key(i) for i in range(config.num_hidden_layers)]
        self.rotaries = {key: RotaryEmbedding(config, key) for key in dict.fromkeys(self.rope_keys)}

    # ---- hooks a family overrides ------------------------------------------------------------------------

    def _attention_biases(self) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o)."""
        return False, False

    def _mlp_bias(self) -> bool:
        return False

    def _qk_norm(self) -> Callable[[int], nn.Module] | None:
        return None

    def _attention_scale(self) -> float:
        return self._head_dim**-0.5

    def _sliding_window(self, layer_idx: int) -> int | None:
        return None

    def _rope_key(self, layer_idx: int) -> str | None:
        """Which rope parameters a layer uses: None for the config's single ``rope_parameters``."""
        return None

    def _activation(self) -> str:
        return self.config.hidden_act

    def _make_norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, self.config.rms_norm_eps)

    def _make_layer(self, layer_idx: int) -> nn.Module:
        return DecoderLayer(self._make_attention(layer_idx), self._make_mlp(), self._make_norm, self.config.hidden_size)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    # ---- building blocks ---------------------------------------------------------------------------------

    def _make_attention(self, layer_idx: int) -> Attention:
        config = self.config
        qkv_bias, o_bias = self._attention_biases()
        return Attention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=self._head_dim,
            layer_idx=layer_idx,
            backend=self.backend,
            scale=self._attention_scale(),
            sliding_window=self._sliding_window(layer_idx),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=self._qk_norm(),
        )

    def _make_mlp(self) -> GatedMLP:
        config = self.config
        return GatedMLP(config.hidden_size, config.intermediate_size, self._activation(), self._mlp_bias())

    # ---- CausalLM ----------------------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv: KVCacheStorage,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        hidden, residual = self._embed(input_ids), None
        max_position = max(attn.inputs.seq_lens_list) - 1
        # cos / sin gathered once per step for each rope kind, shared by the layers
        ropes = {key: rotary(positions, max_position, hidden.dtype) for key, rotary in self.rotaries.items()}
        for layer, rope_key in zip(self.layers, self.rope_keys):
            hidden, residual = layer(hidden, residual, ropes[rope_key], attn, kv, lora)
        return self.norm(hidden, residual)

    def lora_projections(self) -> Projections:
        projections: Projections = {}
        for module_name, module in self.layers.named_modules(prefix="layers"):
            if isinstance(module, PackedLinear):
                parent = module_name.rpartition(".")[0]
                projections.update({_hf_name(f"{parent}.{shard}"): (module, shard) for shard in module.shards})
            elif isinstance(module, Linear):
                projections[_hf_name(module_name)] = (module, None)
        return projections

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads  # this rank's, under tensor parallelism

    @property
    def head_dim(self) -> int:
        return self._head_dim

    def tie_weights(self) -> None:
        # One parameter under two modules, as in HF; the checkpoint fills it as the embeddings. A linear method
        # that re-lays out the head's weight does so into a copy: the embeddings stay as loaded.
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight

    def layer_windows(self) -> list[int | None]:
        return [layer.self_attn.sliding_window for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaders = self._weight_loaders()
        loaded: set[str] = set()
        for name, tensor in weights:
            if self._is_ignored(name):
                continue
            if name not in loaders:
                raise CheckpointError(f"unexpected tensor {name!r}: {type(self).__name__} has no parameter for it")
            try:
                loaders[name](tensor)
            except WeightShapeError as error:
                raise CheckpointError(f"tensor {name!r} has shape {error.got}, but {type(self).__name__} "
                                      f"expects {error.expected}") from None
            loaded.add(name)
        missing = [name for name in loaders if name not in loaded]
        if missing:
            listed = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise CheckpointError(f"the checkpoint is missing {len(missing)} tensor(s): {listed}")

    def _weight_loaders(self) -> WeightLoaders:
        """HF tensor name -> what copies it in: a linear layer's method (packed projections into their rows),
        the embeddings (this rank's rows), else a plain copy into the parameter."""
        loaders: WeightLoaders = {}
        for module_name, module in self.named_modules():
            if self.tied and module is self.lm_head:
                continue
            for kind, param in module.named_parameters(recurse=False):
                if isinstance(module, Linear):
                    loaders.update(_linear_loaders(module_name, module, kind))
                elif isinstance(module, VocabEmbedding):
                    loaders[_hf_name(f"{module_name}.{kind}")] = module.load_weight
                else:
                    loaders[_hf_name(f"{module_name}.{kind}")] = partial(copy_weight, param)
        if self.tied:
            embeddings = _hf_name("embed_tokens.weight")
            loaders[embeddings] = partial(_load_tied, loaders[embeddings], self.lm_head)
        return loaders

    def _is_ignored(self, name: str) -> bool:
        # Old Llama checkpoints store each layer's rotary inv_freq buffer; a tied model may still store
        # lm_head.weight equal to the embeddings (the loader unties one that differs, as transformers does).
        return name.endswith(".rotary_emb.inv_freq") or (self.tied and name == "lm_head.weight")


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _load_tied(load_embeddings: Callable[[torch.Tensor], None], lm_head: Linear, tensor: torch.Tensor) -> None:
    load_embeddings(tensor)
    lm_head.method.load_tied_weight(lm_head, tensor)


def _linear_loaders(module_name: str, linear: Linear, kind: str) -> WeightLoaders:
    """A packed layer's ``kind`` tensors are named by their projection, beside the layer (``self_attn.q_proj``)."""
    if not isinstance(linear, PackedLinear):
        return {_hf_name(f"{module_name}.{kind}"): partial(linear.load_weight, kind)}
    parent = module_name.rpartition(".")[0]
    return {_hf_name(f"{parent}.{shard}.{kind}"): partial(linear.load_weight, kind, shard=shard)
            for shard in linear.shards}


class LlamaForCausalLM(DecoderLM):
    """Llama: biases only where ``attention_bias`` / ``mlp_bias`` ask for them (then on o and down too)."""

    def _attention_biases(self) -> tuple[bool, bool]:
        return self.config.attention_bias, self.config.attention_bias

    def _mlp_bias(self) -> bool:
        return self.config.mlp_bias
