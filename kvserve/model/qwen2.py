"""Qwen2 / Qwen2.5: Llama with a bias on q, k and v (not on o), and optional sliding layers from ``layer_types``."""

from __future__ import annotations

from kvserve.model.llama import DecoderLM, layer_type_window


class Qwen2ForCausalLM(DecoderLM):
    def _attention_biases(self) -> tuple[bool, bool]:
        return True, False

    def _sliding_window(self, layer_idx: int) -> int | None:
        return layer_type_window(self.config, layer_idx)
