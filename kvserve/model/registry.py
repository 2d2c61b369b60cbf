"""Architecture name -> model class, and building a model ready for ``load_weights``."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from kvserve.attention.backend import AttentionBackend
from kvserve.model.base import CausalLM
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.mistral import MistralForCausalLM
from kvserve.model.qwen2 import Qwen2ForCausalLM
from kvserve.model.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
# for configs that name no architecture
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture kvserve has no model class for."""


def get_model_class(config: PretrainedConfig) -> type[CausalLM]:
    """The class for ``config.architectures[0]``, or for ``config.model_type`` when no architecture is named."""
    architectures = getattr(config, "architectures", None)
    if architectures:
        architecture = architectures[0]
    else:
        architecture = MODEL_TYPES.get(config.model_type, f"model_type {config.model_type!r}")
    if architecture not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}"
        )
    return MODEL_CLASSES[architecture]


def build_model(
    config: PretrainedConfig, backend: AttentionBackend, dtype: torch.dtype, device: torch.device | str
) -> CausalLM:
    """The model for ``config`` in ``dtype`` on ``device``, its parameters allocated but not initialised:
    ``load_weights`` must fill them (it checks that every one is filled)."""
    model_class = get_model_class(config)
    with torch.device("meta"):  # no memory and no random init for weights about to be overwritten
        model = model_class(config, backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    return model
