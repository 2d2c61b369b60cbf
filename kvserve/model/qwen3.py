"""Qwen3: Qwen2 with a per-head RMSNorm on q and k before RoPE, and biases only if ``attention_bias``."""

from __future__ import annotations

from functools import partial
from typing import Callable

from torch import nn

from kvserve.model.layers.norm import RMSNorm
from kvserve.model.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    def _attention_biases(self) -> tuple[bool, bool]:
        return self.config.attention_bias, self.config.attention_bias

    def _qk_norm(self) -> Callable[[int], nn.Module] | None:
        return partial(RMSNorm, eps=self.config.rms_norm_eps)
