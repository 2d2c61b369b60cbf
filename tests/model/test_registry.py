"""Architecture lookup and model building."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, PretrainedConfig, Qwen3Config

from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.qwen3 import Qwen3ForCausalLM
from kvserve.model.registry import MODEL_CLASSES, UnsupportedModelError, build_model, get_model_class

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("architecture", sorted(MODEL_CLASSES))
def test_every_architecture_has_its_class(architecture: str) -> None:
    config = PretrainedConfig(architectures=[architecture])
    assert get_model_class(config) is MODEL_CLASSES[architecture]


def test_model_type_is_the_fallback() -> None:
    assert get_model_class(Qwen3Config(**TINY)) is Qwen3ForCausalLM
    assert get_model_class(Gemma3TextConfig(**TINY)) is Gemma3ForCausalLM


def test_unsupported_architecture_is_named_with_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Gemma3ForCausalLM"):
        get_model_class(PretrainedConfig(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        get_model_class(PretrainedConfig.from_dict({"model_type": "gpt2"}))


def test_build_model_allocates_in_the_dtype_on_the_device() -> None:
    model = build_model(LlamaConfig(**TINY, vocab_size=100), TorchRefBackend(), torch.bfloat16, "cpu")
    assert isinstance(model, LlamaForCausalLM)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 8)


def test_unsupported_rope_and_gemma_options_are_rejected() -> None:
    dynamic = LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        build_model(dynamic, TorchRefBackend(), torch.float32, "cpu")
    softcapped = Gemma3TextConfig(**TINY, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        build_model(softcapped, TorchRefBackend(), torch.float32, "cpu")
