"""Rotary tables: built for the positions steps can reach, not for whatever context length a config claims."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from kvserve.model.layers.rotary import MAX_ROPE_TABLE_POSITIONS, RotaryEmbedding, rope_table_positions


def tiny_config(max_position_embeddings: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=max_position_embeddings)


def test_a_huge_context_length_builds_no_huge_table_and_a_table_grows_to_a_step() -> None:
    """2^40 positions were 8 TB of tables at the first step (2^24: GBs), though max_model_len bounds every position."""
    rotary = RotaryEmbedding(tiny_config(2**40))
    assert rope_table_positions(tiny_config(2**40)) == MAX_ROPE_TABLE_POSITIONS
    cos, _ = rotary(torch.tensor([0, 5]), 5, torch.float32)
    assert rotary._cos.shape[0] == MAX_ROPE_TABLE_POSITIONS
    far = MAX_ROPE_TABLE_POSITIONS + 3
    far_cos, far_sin = rotary(torch.tensor([5, far]), far, torch.float32)
    assert rotary._cos.shape[0] > far and torch.equal(far_cos[0], cos[1])
    angle = far * rotary.inv_freq
    torch.testing.assert_close(far_cos[1, 0], angle.cos())
    torch.testing.assert_close(far_sin[1, 0], angle.sin())
    assert rope_table_positions(tiny_config(512)) == 512
