"""Architecture lookup and model building."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, MinistralConfig, MistralConfig, PretrainedConfig, Qwen3Config

from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.mistral import MistralForCausalLM
from kvserve.model.qwen3 import Qwen3ForCausalLM
from kvserve import LLM, SamplingParams
from kvserve.model.base import CheckpointError
from kvserve.model.registry import (
    DUMMY_WEIGHT_BOUND,
    MODEL_CLASSES,
    UnsupportedModelError,
    build_model,
    get_model_class,
)

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


def test_an_architecture_of_another_family_than_the_model_type_is_refused_naming_both() -> None:
    mistral_as_llama = MistralConfig(**TINY, architectures=["LlamaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="'LlamaForCausalLM' but its model_type is 'mistral'"):
        get_model_class(mistral_as_llama)


def test_a_ministral_config_is_a_mistral_with_layer_types() -> None:
    """transformers reads a Mistral config.json that has layer_types as Ministral's, architectures kept."""
    assert get_model_class(MinistralConfig(**TINY)) is MistralForCausalLM
    assert get_model_class(MinistralConfig(**TINY, architectures=["MistralForCausalLM"])) is MistralForCausalLM


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
    partial = LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                                                   "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 .* with rope_type 'linear' is not supported"):
        build_model(partial, TorchRefBackend(), torch.float32, "cpu")
    softcapped = Gemma3TextConfig(**TINY, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        build_model(softcapped, TorchRefBackend(), torch.float32, "cpu")


@pytest.fixture
def config_only_llama(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> Path:
    """The tiny llama checkpoint's directory without its weights."""
    out = tmp_path / "config-only"
    shutil.copytree(tiny_checkpoints["llama"], out, ignore=shutil.ignore_patterns("*.safetensors"))
    return out


def test_dummy_weights_run_a_config_only_directory_at_its_shapes(config_only_llama: Path) -> None:
    with pytest.raises(CheckpointError, match="load_format='dummy'"):
        LLM(str(config_only_llama), num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 30, 31] * 5}
    runs = []
    for _ in range(2):
        llm = LLM(str(config_only_llama), num_kv_blocks=64, load_format="dummy")
        runs.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
        model = llm.engine.core.runner.model
        embeddings = model.embed_tokens.weight
        assert embeddings.abs().max() <= DUMMY_WEIGHT_BOUND and embeddings.std() > DUMMY_WEIGHT_BOUND / 4
    assert len(runs[0]) == 6 and runs[0] == runs[1]  # seeded: the same weights each time


def test_dummy_weights_keep_no_gguf_blocks(config_only_llama: Path) -> None:
    with pytest.raises(ValueError, match="load_format='dummy' draws dense random weights; quantization='gguf'"):
        LLM(str(config_only_llama), num_kv_blocks=64, load_format="dummy", quantization="gguf")
    int8 = LLM(str(config_only_llama), num_kv_blocks=64, load_format="dummy", quantization="int8")
    assert int8.stats()["weights_format"].startswith("int8")
