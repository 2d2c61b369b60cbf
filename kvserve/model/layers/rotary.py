"""Rotary position embeddings: inverse frequencies from transformers' own rope functions, cos/sin tables built once.

The tables are half width: HF's ``q * cos + rotate_half(q) * sin`` with ``cos = cat(c, c)`` is, written per
half, ``(q1 * c - q2 * sin, q2 * c + q1 * s)``; computing it that way gives the same fp32 values and halves
the table.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# These rescale the frequencies from the longest sequence of each forward pass: a paged batch mixes
# sequences, so one table cannot serve them.
SEQUENCE_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
MAX_ROPE_TABLE_POSITIONS = 2**17  # Llama 3.1's 128K: 64 MB of fp32 tables at head_dim 128


def rope_head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_inv_freq(config: PretrainedConfig, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the cos/sin scaling (``attention_factor``) of ``config``'s rope.

    ``layer_type`` selects the per-layer-type parameters of models that have them (Gemma 3).
    """
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    with torch.device("cpu"):  # also when the model is being built on the meta device
        if rope_type == "default":  # not in ROPE_INIT_FUNCTIONS: each HF model class carries this formula
            dim = rope_head_dim(config)
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            return _divided_by_factors(inv_freq, getattr(config, "rope_frequency_factors", None)), 1.0
        if rope_type in SEQUENCE_DEPENDENT_ROPE_TYPES or rope_type not in ROPE_INIT_FUNCTIONS:
            static = ["default", *sorted(set(ROPE_INIT_FUNCTIONS) - set(SEQUENCE_DEPENDENT_ROPE_TYPES))]
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(static)}")
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
    if inv_freq.numel() != rope_head_dim(config) // 2:  # the rest of each head would have to pass unrotated
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        raise ValueError(f"partial_rotary_factor={factor} (rotary embeddings over part of each head) with rope_type "
                         f"{rope_type!r} is not supported")
    return inv_freq, attention_factor


def _divided_by_factors(inv_freq: torch.Tensor, factors: list[float] | None) -> torch.Tensor:
    """A GGUF's per-frequency rope divisors (``model/gguf_metadata.py``: Llama 3.1's scaling as llama.cpp stores
    it) applied; ValueError for a list that is not one factor per frequency."""
    if factors is None:
        return inv_freq
    if len(factors) != inv_freq.numel():
        raise ValueError(f"rope_frequency_factors has {len(factors)} factors for {inv_freq.numel()} frequencies")
    return inv_freq / torch.tensor(factors, dtype=torch.float)


def rope_table_positions(config: PretrainedConfig) -> int:
    """The positions the rotary tables cover from the start: the model's context length, up to
    ``MAX_ROPE_TABLE_POSITIONS`` (a config may claim 2^31, tables of tens of GB that no request reaches; a
    longer context grows them as steps reach it, ``max_model_len`` bounding what they can)."""
    return min(config.max_position_embeddings, MAX_ROPE_TABLE_POSITIONS)


class RotaryEmbedding:
    """cos/sin at any position, from tables covering ``rope_table_positions`` (grown if a step needs more).

    The tables are built on first use on the device and in the dtype of the step (HF casts cos/sin to the
    activation dtype before rotating), and rebuilt if either changes.
    """

    def __init__(self, config: PretrainedConfig, layer_type: str | None = None) -> None:
        self.inv_freq, self.attention_scaling = rope_inv_freq(config, layer_type)
        self.num_positions = rope_table_positions(config)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def __call__(
        self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` ([T]), shaped [T, 1, head_dim / 2] to broadcast over heads.

        ``max_position`` bounds ``positions`` (a host int, so that checking it needs no device sync).
        """
        if self._cos is None or self._cos.device != positions.device or self._cos.dtype != dtype:
            self._build(max(self.num_positions, max_position + 1), positions.device, dtype)
        elif max_position >= self._cos.shape[0]:
            self._build(max(2 * self._cos.shape[0], max_position + 1), positions.device, dtype)
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)

    def _build(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        # the same fp32 product HF forms from position_ids, so the angles are identical
        angles = torch.arange(num_positions, device=device).float()[:, None] * self.inv_freq.to(device)
        self._cos = (angles.cos() * self.attention_scaling).to(dtype)
        self._sin = (angles.sin() * self.attention_scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (HF's half-split convention) by the angles of ``cos``/``sin``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
