"""load_weights: every Hugging Face tensor lands in the right (packed) rows, and a bad checkpoint fails with a
CheckpointError that names the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.model.base import CausalLM, CheckpointError
from kvserve.model.registry import build_model


def fresh_model(directory: Path) -> CausalLM:
    return build_model(AutoConfig.from_pretrained(directory), TorchRefBackend(), torch.float32, "cpu")


@pytest.fixture
def qwen2_weights(tiny_checkpoints: dict[str, Path]) -> dict[str, torch.Tensor]:
    return load_file(tiny_checkpoints["qwen2"] / "model.safetensors")


def test_packed_projections_hold_the_hf_tensors_in_order(tiny_checkpoints: dict[str, Path], qwen2_weights) -> None:
    model = fresh_model(tiny_checkpoints["qwen2"])
    model.load_weights(qwen2_weights.items())
    attn = model.layers[1].self_attn
    hf = "model.layers.1.self_attn"
    expected_weight = torch.cat([qwen2_weights[f"{hf}.{p}_proj.weight"] for p in "qkv"])
    expected_bias = torch.cat([qwen2_weights[f"{hf}.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, expected_weight)
    assert torch.equal(attn.qkv_proj.bias, expected_bias)
    mlp = "model.layers.1.mlp"
    expected_gate_up = torch.cat([qwen2_weights[f"{mlp}.gate_proj.weight"], qwen2_weights[f"{mlp}.up_proj.weight"]])
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, expected_gate_up)


def test_a_tied_head_ignores_a_stored_lm_head(tiny_checkpoints: dict[str, Path], qwen2_weights) -> None:
    model = fresh_model(tiny_checkpoints["qwen2"])
    embeddings = qwen2_weights["model.embed_tokens.weight"]
    model.load_weights([*qwen2_weights.items(), ("lm_head.weight", torch.zeros_like(embeddings))])
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embeddings)


def test_missing_tensor_is_named(tiny_checkpoints: dict[str, Path], qwen2_weights) -> None:
    del qwen2_weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        fresh_model(tiny_checkpoints["qwen2"]).load_weights(qwen2_weights.items())


def test_missing_untied_lm_head_is_named(tiny_checkpoints: dict[str, Path]) -> None:
    weights = load_file(tiny_checkpoints["llama"] / "model.safetensors")
    del weights["lm_head.weight"]
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        fresh_model(tiny_checkpoints["llama"]).load_weights(weights.items())


def test_wrong_shape_is_named(tiny_checkpoints: dict[str, Path], qwen2_weights) -> None:
    name = "model.layers.0.self_attn.k_proj.bias"
    qwen2_weights[name] = torch.zeros(qwen2_weights[name].shape[0] + 1)
    with pytest.raises(CheckpointError, match=rf"{name}.*shape \[33\].*expects \[32\]"):
        fresh_model(tiny_checkpoints["qwen2"]).load_weights(qwen2_weights.items())


def test_unexpected_tensor_is_named(tiny_checkpoints: dict[str, Path], qwen2_weights) -> None:
    name = "model.layers.0.self_attn.o_proj.bias"  # Qwen2 has no bias on o
    qwen2_weights[name] = torch.zeros(64)
    with pytest.raises(CheckpointError, match=rf"unexpected tensor '{name}'"):
        fresh_model(tiny_checkpoints["qwen2"]).load_weights(qwen2_weights.items())
