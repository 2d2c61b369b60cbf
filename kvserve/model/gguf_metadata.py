"""The settings of a GGUF's metadata that transformers' GGUF reader leaves out of the config, applied to it, or the
file refused naming the key: a setting dropped would change the model's math with no word said.

llama.cpp's converter writes a model's rope scaling as ``{arch}.rope.scaling.*`` (linear and YaRN: Gemma 3 4B and
up, YaRN Qwen2.5), Llama 3.1's ``llama3`` scaling as a tensor of per-frequency divisors (``rope_freqs.weight``:
each inverse frequency divided by its factor, which is the llama3 formula's result), Gemma 3's local layers' rope
base as ``rope.freq_base_swa`` and its logit softcappings as ``*_logit_softcapping``; transformers maps none of
them for these architectures, and builds the unscaled model.
"""

from __future__ import annotations

from typing import Mapping

from transformers import PretrainedConfig

from kvserve.model.base import CheckpointError
from kvserve.model.gguf_table import Scalar

ROPE_FREQS_TENSOR = "rope_freqs.weight"
# llama.cpp's YaRN keys -> the names of transformers' yarn parameters
_YARN_KEYS = {"rope.scaling.yarn_beta_fast": "beta_fast", "rope.scaling.yarn_beta_slow": "beta_slow",
              "rope.scaling.yarn_attn_factor": "attention_factor"}
_SCALING_KEYS = ("rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length", *_YARN_KEYS)
_GEMMA3_KEYS = ("rope.freq_base_swa", "final_logit_softcapping")


def apply_gguf_settings(config: PretrainedConfig, architecture: str, scalars: Mapping[str, Scalar],
                        rope_factors: list[float] | None) -> None:
    """Set on ``config`` (transformers' config of the file) the rope scaling, the per-frequency rope factors
    (``rope_factors``, the ``rope_freqs.weight`` tensor's values) and Gemma 3's local rope base and final
    softcapping that ``scalars`` (the file's metadata) hold; CheckpointError naming a key it cannot apply."""
    settings = {key[len(architecture) + 1:]: value for key, value in scalars.items()
                if key.startswith(architecture + ".")}
    _refuse_unknown(settings, architecture)
    scaling = _rope_scaling(settings, architecture)
    if scaling:
        _full_attention_parameters(config).update(scaling)
    if rope_factors is not None:
        if scaling or "full_attention" in config.rope_parameters:
            beside = "a rope.scaling.type" if scaling else "rope parameters per layer type"
            raise CheckpointError(f"{ROPE_FREQS_TENSOR} with {beside}: kvserve applies per-frequency factors to one "
                                  "plain rope only")
        config.rope_frequency_factors = [float(f) for f in rope_factors]
    if "rope.freq_base_swa" in settings:
        config.rope_parameters["sliding_attention"]["rope_theta"] = float(settings["rope.freq_base_swa"])
    if "final_logit_softcapping" in settings:
        config.final_logit_softcapping = float(settings["final_logit_softcapping"])


def _refuse_unknown(settings: dict[str, Scalar], architecture: str) -> None:
    """The settings that change the math and that kvserve does not apply for this architecture."""
    applied = {*_SCALING_KEYS, *(_GEMMA3_KEYS if architecture == "gemma3" else ())}
    unapplied = [key for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier",
                                 "rope.scaling.attn_factor", "attn_logit_softcapping", "final_logit_softcapping",
                                 "rope.freq_base_swa", "attention.sliding_window_pattern")
                 if key in settings and key not in applied]
    if architecture != "gemma3" and "attention.sliding_window" in settings:  # transformers maps Gemma 3's alone
        unapplied.append("attention.sliding_window")
    if unapplied:
        raise CheckpointError(f"this GGUF's metadata sets {', '.join(f'{architecture}.{k}' for k in unapplied)}, "
                              "which kvserve does not apply to this architecture; load the model's safetensors "
                              "checkpoint instead")


def _rope_scaling(settings: dict[str, Scalar], architecture: str) -> dict[str, object]:
    """The rope parameters the file's scaling keys say (linear or YaRN), {} for none."""
    kind = settings.get("rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind not in ("linear", "yarn") or "rope.scaling.factor" not in settings:
        raise CheckpointError(f"{architecture}.rope.scaling.type is {kind!r}"
                              f"{'' if 'rope.scaling.factor' in settings else ' with no rope.scaling.factor'}: "
                              "kvserve applies linear and yarn scaling with a factor")
    parameters: dict[str, object] = {"rope_type": kind, "factor": float(settings["rope.scaling.factor"])}
    if kind == "yarn":
        if "rope.scaling.original_context_length" not in settings:
            raise CheckpointError(f"{architecture}.rope.scaling.type is 'yarn' with no "
                                  f"{architecture}.rope.scaling.original_context_length")
        parameters["original_max_position_embeddings"] = int(settings["rope.scaling.original_context_length"])
        parameters.update({name: float(settings[key]) for key, name in _YARN_KEYS.items() if key in settings})
    return parameters


def _full_attention_parameters(config: PretrainedConfig) -> dict:
    """The rope parameters a scaling applies to: the model's, or those of its full-attention layers (Gemma 3's
    local layers keep theirs, as llama.cpp does)."""
    parameters = config.rope_parameters
    return parameters["full_attention"] if "full_attention" in parameters else parameters
