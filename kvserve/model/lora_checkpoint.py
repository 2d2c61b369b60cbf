"""``make_lora_adapter``: a seeded random LoRA adapter in PEFT's format for a base checkpoint, for tests (no
adapter can be downloaded where they run) and ``kvserve make-lora``.

A and B are both drawn (PEFT starts B at zero, which would leave the model unchanged), scaled so that the adapter
moves the tiny checkpoints' greedy tokens; ``zero_b`` writes B as zeros, an adapter equal to the base model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from kvserve.model.layers.rotary import rope_head_dim
from kvserve.model.loader import load_checkpoint
from kvserve.model.lora_adapter import CONFIG_FILE, LORA_TARGETS, WEIGHTS_FILE
from kvserve.model.sources import resolve_model

LORA_INIT_STD = 0.15  # A and B ~ N(0, LORA_INIT_STD)


def make_lora_adapter(base: str | Path, out_dir: str | Path, *, rank: int = 8, alpha: float = 16,
                      targets: Sequence[str] = LORA_TARGETS, seed: int = 0, zero_b: bool = False,
                      use_rslora: bool = False) -> Path:
    """Write adapter_config.json and adapter_model.safetensors (fp32) into ``out_dir`` for the model ``base`` (what
    ``kvserve serve`` takes: a Hugging Face directory, a GGUF file, a packaged model's name once pulled),
    targeting ``targets`` of every decoder layer; returns ``out_dir``."""
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(f"targets must be some of {', '.join(LORA_TARGETS)}, got {list(targets)}")
    config = _base_config(base)
    shapes = _projection_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            in_features, out_features = shapes[target]
            module = f"base_model.model.model.layers.{layer}.{_block(target)}.{target}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * LORA_INIT_STD
            b = torch.randn(out_features, rank, generator=generator) * LORA_INIT_STD
            tensors[f"{module}.lora_B.weight"] = torch.zeros_like(b) if zero_b else b
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE))
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(targets), "use_rslora": use_rslora,
        "bias": "none", "modules_to_save": None, "use_dora": False, "fan_in_fan_out": False, "rank_pattern": {},
        "alpha_pattern": {}, "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2) + "\n")
    return out


def _base_config(base: str | Path) -> PretrainedConfig:
    """The base model's text config as kvserve reads it (a GGUF's settings included; no weight is read)."""
    config = load_checkpoint(resolve_model(str(base), auto_pull=False), torch.float32).hf_config
    return getattr(config, "text_config", config)


def _projection_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """Each target's (in_features, out_features) in a decoder layer of ``config``."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * rope_head_dim(config)
    kv_size = config.num_key_value_heads * rope_head_dim(config)
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}


def _block(target: str) -> str:
    return "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
