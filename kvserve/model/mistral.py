"""Mistral: Llama without biases, every layer attending over ``config.sliding_window`` keys (None: all)."""

from __future__ import annotations

from kvserve.model.llama import DecoderLM


class MistralForCausalLM(DecoderLM):
    def _sliding_window(self, layer_idx: int) -> int | None:
        return self.config.sliding_window
