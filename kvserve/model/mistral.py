"""Mistral: Llama without biases, every layer attending over ``config.sliding_window`` keys (None: all); with
``layer_types`` (Ministral, as transformers reads a Mistral config that has them), only the sliding layers."""

from __future__ import annotations

from kvserve.model.llama import DecoderLM, layer_type_window


class MistralForCausalLM(DecoderLM):
    def _sliding_window(self, layer_idx: int) -> int | None:
        if getattr(self.config, "layer_types", None):
            return layer_type_window(self.config, layer_idx)
        return self.config.sliding_window
