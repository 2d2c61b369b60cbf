"""A GGUF's settings that transformers' reader leaves out (``model/gguf_metadata.py``): rope scaling written as
llama.cpp writes it gives the output of the same weights under that scaling in transformers; a setting kvserve
does not apply is refused naming its key."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from transformers import Gemma3TextConfig

from kvserve import LLM, SamplingParams
from kvserve.model.base import CheckpointError
from kvserve.model.gguf_metadata import apply_gguf_settings
from kvserve.model.gguf_table import GGUFTable
from kvserve.model.loader import load_checkpoint
from tests.conftest import hf_greedy
from tests.model.test_loader import byte_level_tokens, gguf_location, tiny_llama, write_gguf

MAX_NEW = 12
PROMPT = [(7 * i + 3) % 200 for i in range(90)]  # past the original context of the scalings below
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def llama3_factors(parameters: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for a llama3 scaling: each frequency's divisor, from the published formula."""
    freqs = 1.0 / (parameters["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = parameters["factor"], parameters["low_freq_factor"], parameters["high_freq_factor"]
    context = parameters["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_greedy(path: Path) -> list[int]:
    llm = LLM(str(path), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids


def sharp_llama(**overrides) -> torch.nn.Module:
    """``tiny_llama`` with weights large enough that where the rope puts its angles decides the greedy tokens (at
    its own initialisation the logits are nearly flat); the same weights whatever ``overrides`` say."""
    model = tiny_llama(vocab_size=len(byte_level_tokens()[0]), **overrides)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.25 + (parameter.dim() == 1))
    return model.eval()


def scaled_file(tmp_path: Path, extra: Callable[[gguf.GGUFWriter], None]) -> Path:
    return write_gguf(tmp_path / "scaled.gguf", sharp_llama(), extra=extra)


@pytest.mark.parametrize("write, rope_parameters", [
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(4.0)),
     {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0),
                w.add_rope_scaling_orig_ctx_len(32), w.add_rope_scaling_yarn_beta_fast(16.0)),
     {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
      "beta_fast": 16.0}),
    (lambda w: w.add_tensor("rope_freqs.weight", llama3_factors(LLAMA3, 16)), LLAMA3),
    (lambda w: w.add_float32("llama.rope.scale_linear", 4.0), {"rope_type": "linear", "rope_theta": 10000.0,
                                                              "factor": 4.0}),
    (lambda w: w.add_rope_scaling_factor(4.0), {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
], ids=["linear", "yarn", "llama3 as rope_freqs", "the old linear key", "a factor with no type: linear"])
def test_a_rope_scaling_in_the_metadata_is_applied_as_transformers_applies_it(tmp_path, write, rope_parameters):
    """transformers' own GGUF reader builds these files unscaled (the GGUF here: head_dim 16, as ``tiny_llama``)."""
    path = scaled_file(tmp_path, write)
    want = hf_greedy(sharp_llama(rope_parameters=rope_parameters), PROMPT, MAX_NEW)
    assert want != hf_greedy(sharp_llama(), PROMPT, MAX_NEW)  # the scaling changes the answer
    assert gguf_greedy(path) == want


@pytest.mark.parametrize("write, message", [
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE), w.add_rope_scaling_factor(4.0)),
     "llama.rope.scaling.type is 'longrope'"),
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0)),
     "no llama.rope.scaling.original_context_length"),
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(2.0),
                w.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))), "rope_freqs.weight with a"),
    (lambda w: w.add_float32("llama.rope.scaling.attn_factor", 2.0), "attn_factor is 2.0"),
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0),
                w.add_rope_scaling_orig_ctx_len(32), w.add_float32("llama.rope.scaling.yarn_log_multiplier", 0.1)),
     "yarn_log_multiplier is 0.1"),
    (lambda w: w.add_tensor("blk.0.attn_sinks.weight", np.ones(4, dtype=np.float32)),
     "tensors no llama model of transformers' reads: blk.0.attn_sinks.weight"),
], ids=["longrope", "yarn without its context", "two scalings", "a cos and sin scale", "a yarn log multiplier",
        "a tensor no layer reads"])
def test_a_setting_kvserve_does_not_apply_is_refused_naming_it(tmp_path, write, message) -> None:
    path = scaled_file(tmp_path, write)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(gguf_location(path), torch.float32)


def test_the_keys_llama_cpps_saver_writes_for_every_model_change_nothing_they_do_not_change(tmp_path) -> None:
    """``llama_model_save_to_file`` (llama-finetune's output) writes every hyperparameter: for a Llama, softcappings
    its graph never reads, a window of 0, scalings of 1. Refused for being there, such a file loaded before."""
    def saver_keys(writer: gguf.GGUFWriter) -> None:
        writer.add_float32("llama.attn_logit_softcapping", 50.0)
        writer.add_float32("llama.final_logit_softcapping", 30.0)
        writer.add_uint32("llama.attention.sliding_window", 0)
        writer.add_float32("llama.rope.freq_base_swa", 10000.0)
        writer.add_float32("llama.rope.scaling.attn_factor", 1.0)
        writer.add_float32("llama.rope.scaling.yarn_ext_factor", -1.0)
        writer.add_float32("llama.rope.scaling.yarn_log_multiplier", 0.0)
        writer.add_float32("llama.rope.scaling.factor", 0.0)

    assert gguf_greedy(scaled_file(tmp_path, saver_keys)) == hf_greedy(sharp_llama(), PROMPT, MAX_NEW)


def gemma3(num_layers: int, settings: dict) -> Gemma3TextConfig:
    config = Gemma3TextConfig(num_hidden_layers=num_layers, hidden_size=5376 if num_layers == 62 else 640,
                              num_attention_heads=32 if num_layers == 62 else 4,
                              head_dim=128 if num_layers == 62 else 256, query_pre_attn_scalar=256)
    apply_gguf_settings(config, GGUFTable("gemma3", (), settings), None)
    return config


def test_gemma3s_settings_go_where_transformers_reads_them_as_llama_cpp_reads_them() -> None:
    """The scaling applies to its full-attention layers (its local ones keep theirs, as in llama.cpp), the local
    rope base and pattern where it has a window, the final softcapping where not 0; the attention scale is
    llama.cpp's: 27B's width per head (168), others' head_dim, where transformers' GGUF reader left 256."""
    settings = {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
                "gemma3.attention.sliding_window": 512, "gemma3.rope.freq_base_swa": 20000.0,
                "gemma3.attention.sliding_window_pattern": 3, "gemma3.final_logit_softcapping": 30.0}
    local = dict(Gemma3TextConfig().rope_parameters["sliding_attention"])
    config = gemma3(6, settings)
    assert config.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert config.rope_parameters["full_attention"]["factor"] == 8.0
    assert config.rope_parameters["sliding_attention"] == {**local, "rope_theta": 20000.0}
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert config.final_logit_softcapping == 30.0 and config.query_pre_attn_scalar == 256
    assert gemma3(62, {}).query_pre_attn_scalar == 168
    unwindowed = gemma3(6, {"gemma3.rope.freq_base_swa": 20000.0, "gemma3.final_logit_softcapping": 0.0})
    assert unwindowed.rope_parameters["sliding_attention"] == local and unwindowed.final_logit_softcapping is None
