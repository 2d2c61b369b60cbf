"""LoRA adapters in PEFT's format, read and checked before any request runs with one.

An adapter is a directory holding ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors``, whose tensors PEFT names after the base model's
modules: ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]). A targeted projection ``W`` then computes ``x @ (W + scale * B @ A).T``, ``scale`` being
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

kvserve applies adapters to the decoder layers' linear projections (``LORA_TARGETS``) of every family it serves.
What changes an adapter's arithmetic beyond that is refused by name, never ignored: ``modules_to_save`` (whole
modules replaced), a ``bias`` other than "none", DoRA (``use_dora``), per-module ranks or alphas
(``rank_pattern``, ``alpha_pattern``), embedding or LM-head targets, a rank above ``max_lora_rank``, an adapter
saved over base weights its initialisation changed (PiSSA, OLoRA, CorDA unconverted), a ``use_rslora`` that is not
a boolean, and a tensor holding NaN or inf.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model."
_TENSOR_NAME = re.compile(r"(?P<module>model\.layers\.\d+\.(?:self_attn|mlp)\.(?P<target>\w+))\.lora_(?P<kind>[AB])"
                          r"\.weight")
# config fields that change the arithmetic and are not implemented: (field, why), refused where set
_REFUSED_FIELDS = (
    ("modules_to_save", "whole modules the adapter replaces (kvserve applies low-rank terms only)"),
    ("use_dora", "DoRA's magnitude vectors are not implemented"),
    ("rank_pattern", "per-module ranks are not implemented"),
    ("alpha_pattern", "per-module alphas are not implemented"),
    ("fan_in_fan_out", "Conv1D-style transposed weights (GPT-2) are not a family kvserve serves"),
    ("layer_replication", "layer replication is not implemented"),
    ("lora_bias", "LoRA biases are not implemented"),
    ("target_parameters", "parameter (MoE expert) targets are not implemented"),
    ("trainable_token_indices", "trained embedding rows are not implemented"),
    ("use_qalora", "QA-LoRA is not implemented"),
)

# initialisations that subtract the adapter's first product from the base weights: an adapter saved unconverted
# applies to those changed weights, not to the checkpoint served
_BASE_CHANGING_INITS = ("pissa", "olora", "corda")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the field or tensor."""


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read from its directory. ``weights``: the base model's module name (``model.layers.0.mlp.up_proj``)
    -> (A [r, in], B [out, r]) as stored; ``digest``: BLAKE2b of its config and weights files, which keys its KV
    blocks (a changed adapter behind the same name or path never reads another's KV)."""

    name: str
    path: Path
    rank: int
    scale: float
    digest: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_lora_adapter(path: str | Path, name: str, max_rank: int) -> LoRAAdapter:
    """The adapter in directory ``path``, checked (``LoRAAdapterError`` naming ``name`` and what is wrong);
    its shapes against the model are checked as it is installed (``model/layers/lora.py``)."""
    directory = Path(path)
    config_bytes = _read(directory / CONFIG_FILE, name)
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as error:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON ({error})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    rank = _check_config(config, name, max_rank)
    weights_bytes = _read(directory / WEIGHTS_FILE, name)
    try:
        tensors = load_safetensors(weights_bytes)
    except Exception as error:  # safetensors raises its own error types for a damaged file
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} does not read as safetensors ({error})") \
            from None
    alpha = config.get("lora_alpha", 8)  # PEFT's default
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    digest = hashlib.blake2b(config_bytes + b"\0" + weights_bytes, digest_size=16).hexdigest()
    return LoRAAdapter(name, directory, rank, float(scale), digest, _pairs(tensors, name, rank))


def _read(file: Path, name: str) -> bytes:
    try:
        return file.read_bytes()
    except FileNotFoundError:
        other = " (adapter_model.bin, a pickle, is not read: save the adapter with safetensors)" \
            if file.name == WEIGHTS_FILE and (file.parent / "adapter_model.bin").exists() else ""
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no {file.name} in {file.parent}{other}") from None
    except OSError as error:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {file}: {error.strerror}") from None


def _check_config(config: dict[str, Any], name: str, max_rank: int) -> int:
    """The adapter's rank; ``LoRAAdapterError`` for a config kvserve does not serve as it says."""
    def refuse(field: str, why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} field {field!r}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"{config['peft_type']!r} is not LORA")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse("r", f"the rank must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise refuse("r", f"rank {rank} is above max_lora_rank={max_rank} (--max-lora-rank raises it)")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise refuse("lora_alpha", f"must be a number, got {alpha!r}")
    if not isinstance(config.get("use_rslora", False), bool):  # a string "false" would be truthy: the wrong scale
        raise refuse("use_rslora", f"must be true or false, got {config['use_rslora']!r}")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.startswith(_BASE_CHANGING_INITS):
        raise refuse("init_lora_weights", f"{init!r} trains the adapter over base weights it changed: save it "
                                          "converted to plain LoRA (PEFT's path_initial_model_for_weight_conversion)")
    if config.get("bias", "none") != "none":
        raise refuse("bias", f"{config['bias']!r}: only 'none' is implemented (no bias terms are trained)")
    for field, why in _REFUSED_FIELDS:
        if config.get(field):
            raise refuse(field, why)
    targets = config.get("target_modules")
    if isinstance(targets, list) and (others := [t for t in targets if t not in LORA_TARGETS]):
        raise refuse("target_modules", f"{', '.join(map(repr, others))}: kvserve applies adapters to the decoder "
                                       f"layers' {', '.join(LORA_TARGETS)} only (not embeddings or the LM head)")
    return rank


def _pairs(tensors: dict[str, torch.Tensor], name: str, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each targeted module's (A, B), every tensor accounted for and of rank ``rank``."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(tensor_name.removeprefix(_PEFT_PREFIX))
        if match is None or match["target"] not in LORA_TARGETS:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {tensor_name!r} is not a LoRA A or B of the decoder "
                                   f"layers' {', '.join(LORA_TARGETS)} (embedding, LM-head and DoRA tensors are not "
                                   "implemented)")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {tensor_name!r} is not a 2-D float matrix")
        # a NaN or inf would turn every logit of its requests' rows to NaN: garbage tokens, NaN logprobs
        if not torch.isfinite(tensor).all():
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {tensor_name!r} holds NaN or infinite values")
        halves.setdefault(match["module"], {})[match["kind"]] = tensor
    pairs = {}
    for module, kinds in halves.items():
        if set(kinds) != {"A", "B"}:
            missing = "B" if "A" in kinds else "A"
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} has no lora_{missing}.weight")
        a, b = kinds["A"], kinds["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module}'s lora_A {list(a.shape)} and lora_B "
                                   f"{list(b.shape)} are not of rank r={rank} ({CONFIG_FILE})")
        pairs[module] = (a, b)
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    return pairs
