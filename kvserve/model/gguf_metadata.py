"""The settings of a GGUF's metadata that transformers' GGUF reader leaves out of the config, applied as llama.cpp
reads them, or the file refused naming the key: a setting dropped would change the model's math with no word said.

llama.cpp's converter writes a model's rope scaling as ``{arch}.rope.scaling.*`` (linear and YaRN: Gemma 3 4B and
up, YaRN Qwen2.5; older files a linear factor as ``rope.scale_linear``, with no type: llama.cpp reads a factor
without a type as linear), Llama 3.1's ``llama3`` scaling as a tensor of per-frequency divisors
(``rope_freqs.weight``: each inverse frequency divided by its factor, which is the llama3 formula's result), and
Gemma 3's local layers' rope base and final softcapping; llama.cpp derives Gemma 3's attention scale from the
model's size. transformers maps none of it for these architectures, and builds the unscaled model. Keys an
architecture's llama.cpp graph does not read (llama.cpp's own saver writes every hyperparameter for every model:
a Llama's softcapping 50, a window of 0) change nothing, here as there.
"""

from __future__ import annotations

from typing import Mapping

from transformers import PretrainedConfig

from kvserve.model.base import CheckpointError
from kvserve.model.gguf_table import GGUFTable, Scalar

ROPE_FREQS_TENSOR = "rope_freqs.weight"
# llama.cpp's YaRN keys -> the names of transformers' yarn parameters
_YARN_KEYS = {"rope.scaling.yarn_beta_fast": "beta_fast", "rope.scaling.yarn_beta_slow": "beta_slow",
              "rope.scaling.yarn_attn_factor": "attention_factor"}
# YaRN keys whose values other than these (llama.cpp's "not set") transformers has no parameter for
_YARN_NEUTRAL = {"rope.scaling.yarn_ext_factor": (-1.0, 1.0), "rope.scaling.yarn_log_multiplier": (0.0,)}
GEMMA3_27B_LAYERS = 62  # llama.cpp scales Gemma 3 27B's attention by its width per head, others by head_dim


def apply_gguf_settings(config: PretrainedConfig, table: GGUFTable, rope_factors: list[float] | None) -> None:
    """Set on ``config`` (transformers' config of the file) the rope scaling, the per-frequency rope factors
    (``rope_factors``, the ``rope_freqs.weight`` tensor's values) and Gemma 3's local rope base, layer pattern,
    final softcapping and attention scale that the file's metadata holds; CheckpointError naming a key it cannot
    apply."""
    architecture = table.architecture
    settings = _settings(table.scalars, architecture)
    scaling = _rope_scaling(settings, architecture)
    if scaling:
        _full_attention_parameters(config).update(scaling)
    if rope_factors is not None:
        if scaling or "full_attention" in config.rope_parameters:
            beside = "a rope scaling" if scaling else "rope parameters per layer type"
            raise CheckpointError(f"{ROPE_FREQS_TENSOR} with {beside}: kvserve applies per-frequency factors to one "
                                  "plain rope only")
        config.rope_frequency_factors = [float(f) for f in rope_factors]
    if architecture == "gemma3":
        if f"{architecture}.attention.sliding_window_pattern" in table.array_keys:
            raise CheckpointError(f"{architecture}.attention.sliding_window_pattern is a list of layers: kvserve "
                                  "reads the pattern as a number of layers")
        _apply_gemma3(config, settings)


def _settings(scalars: Mapping[str, Scalar], architecture: str) -> dict[str, Scalar]:
    """The architecture's own keys, without its name (``llama.rope.scaling.type`` -> ``rope.scaling.type``)."""
    return {key[len(architecture) + 1:]: value for key, value in scalars.items() if key.startswith(architecture + ".")}


def _rope_scaling(settings: dict[str, Scalar], architecture: str) -> dict[str, object]:
    """The rope parameters the file's scaling says (linear or YaRN), {} for none, as llama.cpp reads them: the
    factor from ``rope.scaling.factor``, else ``rope.scale_linear``; the type ``linear`` where none is given; a
    factor of 0 or 1 scales nothing."""
    factor = float(settings.get("rope.scaling.factor", settings.get("rope.scale_linear", 0.0)))
    kind = settings.get("rope.scaling.type", "linear")
    if float(settings.get("rope.scaling.attn_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{architecture}.rope.scaling.attn_factor is {settings['rope.scaling.attn_factor']}: "
                              "kvserve does not scale the rope's cos and sin")
    if kind == "none" or (kind in ("linear", "yarn") and factor in (0.0, 1.0)):
        return {}
    if kind not in ("linear", "yarn"):
        raise CheckpointError(f"{architecture}.rope.scaling.type is {kind!r}: kvserve applies linear and yarn scaling")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    return _yarn(settings, architecture, factor)


def _yarn(settings: dict[str, Scalar], architecture: str, factor: float) -> dict[str, object]:
    if "rope.scaling.original_context_length" not in settings:
        raise CheckpointError(f"{architecture}.rope.scaling.type is 'yarn' with no "
                              f"{architecture}.rope.scaling.original_context_length")
    for key, neutral in _YARN_NEUTRAL.items():
        if key in settings and float(settings[key]) not in neutral:
            raise CheckpointError(f"{architecture}.{key} is {settings[key]}: transformers' yarn has no such "
                                  "parameter")
    parameters: dict[str, object] = {"rope_type": "yarn", "factor": factor,
                                     "original_max_position_embeddings": int(settings[
                                         "rope.scaling.original_context_length"])}
    parameters.update({name: float(settings[key]) for key, name in _YARN_KEYS.items() if key in settings})
    return parameters


def _apply_gemma3(config: PretrainedConfig, settings: dict[str, Scalar]) -> None:
    """Gemma 3's settings as llama.cpp's graph reads them: the local layers' rope base (where it has local
    layers), the final softcapping (where not 0), the pattern of local layers, the attention scale."""
    if int(settings.get("attention.sliding_window", 0)) > 0:
        if "rope.freq_base_swa" in settings:
            config.rope_parameters["sliding_attention"]["rope_theta"] = float(settings["rope.freq_base_swa"])
        if "attention.sliding_window_pattern" in settings:
            pattern = int(settings["attention.sliding_window_pattern"])
            config.layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(config.num_hidden_layers)]
    if float(settings.get("final_logit_softcapping", 0.0)):
        config.final_logit_softcapping = float(settings["final_logit_softcapping"])
    per_head = config.hidden_size // config.num_attention_heads
    config.query_pre_attn_scalar = per_head if config.num_hidden_layers == GEMMA3_27B_LAYERS else config.head_dim


def _full_attention_parameters(config: PretrainedConfig) -> dict:
    """The rope parameters a scaling applies to: the model's, or those of its full-attention layers (Gemma 3's
    local layers keep theirs, as llama.cpp does)."""
    parameters = config.rope_parameters
    return parameters["full_attention"] if "full_attention" in parameters else parameters
