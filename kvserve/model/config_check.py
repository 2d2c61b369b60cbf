"""A checkpoint's config checked against itself and against the tensors it stores, before any memory is spent.

Models are built from their config: a config that claims a million layers, a vocabulary of 2^31 tokens or an
MLP of 2^40 rows is allocated as it says (512 GB for that vocabulary), or for GGUF metadata a million decoder
layers are built on the meta device (minutes), before a tensor's shape could disagree. So the sizes are checked
here first, from the tensors' names and row counts alone (their headers: nothing is read), each error naming
the source and the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Mapping

from transformers import PretrainedConfig

from kvserve.model.base import CheckpointError

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.")
# a stored tensor whose rows a config field gives (the output features of a linear, a vocabulary's embeddings)
_ROWS_OF = {"vocab_size": "model.embed_tokens.weight", "intermediate_size": "model.layers.0.mlp.gate_proj.weight"}


def num_stored_layers(tensor_names: Iterable[str], pattern: re.Pattern[str] = _HF_LAYER) -> int | None:
    """How many decoder layers the tensors hold (the highest index + 1), None if none is named."""
    indexes = [int(m.group(1)) for name in tensor_names if (m := pattern.match(name))]
    return max(indexes) + 1 if indexes else None


def num_gguf_blocks(tensor_names: Iterable[str]) -> int | None:
    """``num_stored_layers`` for a GGUF's own tensor names (``blk.N.attn_q.weight``)."""
    return num_stored_layers(tensor_names, _GGUF_BLOCK)


def check_layer_count(num_layers: object, stored: int | None, source: Path, field: str) -> None:
    """CheckpointError unless the config's layer count is a positive integer equal to the tensors' (if any)."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise CheckpointError(f"{source}: {field} must be a positive number of layers, got {num_layers!r}")
    if stored is not None and num_layers != stored:
        raise CheckpointError(f"{source}: {field} says {num_layers} layers, its tensors hold {stored}")


def check_config(config: PretrainedConfig, tensor_rows: Mapping[str, int], source: Path) -> None:
    """The config's sizes are positive, its heads split evenly, and no size is larger than the stored tensors'
    (``tensor_rows``: each tensor's first dimension, by Hugging Face name; empty for a config-only directory,
    whose sizes are then taken as they are). Raises CheckpointError naming ``source`` and the field."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads"):
        value = getattr(text, field, None)
        if not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{source}: {field} must be a positive integer, got {value!r}")
    check_layer_count(text.num_hidden_layers, num_stored_layers(tensor_rows), source, "num_hidden_layers")
    heads, kv_heads = text.num_attention_heads, getattr(text, "num_key_value_heads", None)
    kv_heads = heads if kv_heads is None else kv_heads  # none given: multi-head attention (0 is refused)
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                              f"({kv_heads!r})")
    for field, name in _ROWS_OF.items():
        rows = tensor_rows.get(name)
        if rows is not None and getattr(text, field) > rows:
            raise CheckpointError(f"{source}: {field} is {getattr(text, field)}, but {name} holds {rows} rows")
    _check_attention_rows(text, heads, kv_heads, tensor_rows, source)
    _check_positive_constants(text, source)


def _check_positive_constants(text: PretrainedConfig, source: Path) -> None:
    """A norm's epsilon and every rope's base frequency are positive numbers: a negative epsilon or a base of 0
    loaded and served one token for ever (NaN everywhere)."""
    constants = {"rms_norm_eps": getattr(text, "rms_norm_eps", None)}
    rope = getattr(text, "rope_parameters", None) or {}
    for key, params in ({"": rope} if "rope_theta" in rope else rope).items():  # Gemma 3's: one per layer type
        if isinstance(params, Mapping):
            constants[f"rope_theta{f' ({key})' if key else ''}"] = params.get("rope_theta")
    for field, value in constants.items():
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise CheckpointError(f"{source}: {field} must be a positive number, got {value!r}")


def _check_attention_rows(text: PretrainedConfig, heads: int, kv_heads: int, tensor_rows: Mapping[str, int],
                          source: Path) -> None:
    """The first layer's attention projections hold the rows its heads, head_dim and hidden_size make: a head_dim
    of 2^31 was allocated for its rotary frequencies (minutes, GBs) before a weight could disagree."""
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if not isinstance(head_dim, int) or head_dim < 1:
        raise CheckpointError(f"{source}: head_dim must be a positive integer, got {head_dim!r}")
    attention = "model.layers.0.self_attn."
    for projection, field, expected in (("q_proj", "num_attention_heads x head_dim", heads * head_dim),
                                        ("k_proj", "num_key_value_heads x head_dim", kv_heads * head_dim),
                                        ("o_proj", "hidden_size", text.hidden_size)):
        rows = tensor_rows.get(f"{attention}{projection}.weight")
        if rows is not None and rows != expected:
            raise CheckpointError(f"{source}: {field} is {expected}, but {attention}{projection}.weight holds "
                                  f"{rows} rows")
