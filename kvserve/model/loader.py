"""Read a resolved checkpoint: its config, tokenizer, stop tokens and Hugging Face-named weights.

Two formats: a Hugging Face directory (config.json, tokenizer files, safetensors single or sharded) and a GGUF
file (config, tokenizer and chat template in its metadata; quantized tensors dequantized on read). Both yield the
same tensor names, those of the Hugging Face safetensors checkpoint (``model.layers.0.self_attn.q_proj.weight``),
so a model's ``load_weights`` never knows which format it came from.

Everything that can be checked without reading the tensors is checked in ``load_checkpoint``, so a broken file
fails there, as a ``CheckpointError`` naming the file, before any memory is spent on weights.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from kvserve.model.base import CheckpointError
from kvserve.model.config_check import check_config
from kvserve.model.gguf_index import GGUFIndex, TensorEntry, load_gguf_index
from kvserve.model.layers.ggml import GGMLTensor
from kvserve.model.sources import ModelLocation

_log = logging.getLogger(__name__)
HEAD_TENSOR, EMBEDDINGS_TENSOR = "lm_head.weight", "model.embed_tokens.weight"

WeightIterator = Iterator[tuple[str, torch.Tensor]]

SAFETENSORS_INDEX = "model.safetensors.index.json"
# any one of these lets AutoTokenizer build a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
# generation_config.json's fields that vLLM (since 0.8) takes as the sampling defaults: SamplingParams' names
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# safetensors' names of the floating dtypes torch reads, which the loader casts to the model's dtype
SAFETENSORS_FLOAT_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint whose metadata is loaded and checked; its tensors are read only when ``weights()`` is called."""

    hf_config: PretrainedConfig  # ``architectures`` is always set
    tokenizer: PreTrainedTokenizerBase  # with the checkpoint's chat template, if it has one
    eos_token_ids: frozenset[int]
    max_model_len: int  # the model's own context length (max_position_embeddings)
    read_weights: Callable[[frozenset[int], bool], WeightIterator] = field(repr=False)
    is_gguf: bool = False
    dummy: bool = False  # ``load_format="dummy"``: no weight is read; the model draws random ones of its shapes
    # the floating dtypes a safetensors checkpoint's headers name (empty for a GGUF or a dummy): where they are the
    # model's, the tensors come out as views of the mapped file, uncast
    stored_dtypes: frozenset[torch.dtype] = frozenset()
    # a GGUF's matrices (2-D tensors) by their ggml type: which the block kernels can keep as blocks
    gguf_matrix_types: dict[str, int] = field(default_factory=dict)
    # the sampling fields generation_config.json sets (SAMPLING_DEFAULT_FIELDS, not null), as it sets them
    sampling_defaults: dict[str, float] = field(default_factory=dict)

    def weights(self, keep_quantized: frozenset[int] = frozenset(), mapped: bool = False) -> WeightIterator:
        """Yield ``(hf_name, tensor)`` once per stored tensor, floating tensors cast to the load dtype (a
        safetensors file's: views of the mapped file where they are stored in it); a GGUF's 2-D tensors of the
        ggml types in ``keep_quantized`` come as their blocks (``GGMLTensor``) instead, with ``mapped`` views of
        the mapped file where their rows are stored in order (copies otherwise).

        A tied LM head that the file does not store is not yielded. Each call reads the file again.
        """
        return self.read_weights(keep_quantized, mapped)


def load_checkpoint(location: ModelLocation, dtype: torch.dtype, load_format: str = "auto") -> Checkpoint:
    """Load the config and tokenizer of ``location`` and check its weight files; raises ``CheckpointError``. With
    ``load_format="dummy"`` the weight files are neither needed nor read (a config-only directory loads)."""
    dummy = load_format == "dummy"
    if location.kind == "hf_dir":
        return _load_hf_dir(location.path, dtype, dummy)
    checkpoint = _load_gguf(location.path, dtype)
    return dataclasses.replace(checkpoint, dummy=True) if dummy else checkpoint


# ---- Hugging Face directory ------------------------------------------------------------------------------


def _load_hf_dir(directory: Path, dtype: torch.dtype, dummy: bool = False) -> Checkpoint:
    config = _read_hf_config(directory)
    shards = [] if dummy else _safetensors_shards(directory)
    stored_dtypes, tensor_rows, shard_of = set(), {}, {}
    for shard in shards:
        dtypes, rows = _check_safetensors(shard)
        if twice := sorted(set(rows) & set(tensor_rows)):  # the later copy would silently win
            raise CheckpointError(f"{shard} holds {twice[0]}, which {shard_of[twice[0]].name} holds too"
                                  + (f" (and {len(twice) - 1} more such tensors)" if len(twice) > 1 else ""))
        shard_of |= dict.fromkeys(rows, shard)
        stored_dtypes |= dtypes
        tensor_rows |= rows
    check_config(config, tensor_rows, directory / "config.json")
    if getattr(config, "tie_word_embeddings", False) and HEAD_TENSOR in tensor_rows:
        config = _untied_if_head_differs(config, shards)
    tokenizer = _read_hf_tokenizer(directory)
    generation = _read_json(directory / "generation_config.json")
    return Checkpoint(
        hf_config=config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(generation.get("eos_token_id"), config, tokenizer, directory),
        max_model_len=_max_model_len(config, directory / "config.json"),
        read_weights=partial(_read_safetensors, shards, dtype),
        dummy=dummy,
        stored_dtypes=frozenset(stored_dtypes),
        sampling_defaults={name: generation[name] for name in SAMPLING_DEFAULT_FIELDS
                           if generation.get(name) is not None},  # null: not set, as vLLM reads it
    )


def _untied_if_head_differs(config: PretrainedConfig, shards: list[Path]) -> PretrainedConfig:
    """``config`` untied where the checkpoint stores an LM head that is not its embeddings: transformers (since 5)
    then keeps the stored head, with a warning, rather than tie it; a head equal to the embeddings stays tied, and
    so does one stored without embeddings (whose load then names the missing tensor)."""
    with contextlib.ExitStack() as files:
        readers = [files.enter_context(safe_open(shard, framework="pt")) for shard in shards]
        located = {name: reader for reader in readers for name in (HEAD_TENSOR, EMBEDDINGS_TENSOR)
                   if name in reader.keys()}
        if EMBEDDINGS_TENSOR not in located or _same_tensor(located[HEAD_TENSOR].get_slice(HEAD_TENSOR),
                                                            located[EMBEDDINGS_TENSOR].get_slice(EMBEDDINGS_TENSOR)):
            return config
    _log.warning("the checkpoint's config ties the LM head to the embeddings, but it stores an lm_head.weight of its "
                 "own that differs: that head is used, untied, as transformers does")
    untied = copy.deepcopy(config)
    untied.tie_word_embeddings = False
    return untied


def _same_tensor(a: Any, b: Any, rows: int = 4096) -> bool:
    """Whether two safetensors slices hold the same tensor, compared a block of rows at a time (a 256k-token
    vocabulary's embeddings are GBs)."""
    if a.get_shape() != b.get_shape() or a.get_dtype() != b.get_dtype():
        return False
    num_rows = a.get_shape()[0]
    return all(torch.equal(a[start:start + rows], b[start:start + rows]) for start in range(0, num_rows, rows))


def _read_hf_config(directory: Path) -> PretrainedConfig:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory} has no config.json: it is not a Hugging Face model directory")
    _read_json(config_file)  # a clear error for bad JSON, before transformers wraps it in a vaguer one
    from transformers import AutoConfig  # see _with_architectures

    try:
        config = AutoConfig.from_pretrained(directory)
    # the last three: a field's type or range (``"dtype": "banana"`` is an AttributeError of transformers')
    except (ValueError, OSError, KeyError, StrictDataclassError, AttributeError, TypeError) as error:
        raise CheckpointError(f"{config_file}: transformers cannot build a config from it: {error}") from None
    return _with_architectures(config, config_file)


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the (optional) file is absent."""
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(content).__name__}")
    return content


def _safetensors_shards(directory: Path) -> list[Path]:
    """The weight files in load order: those named by the index, else every ``*.safetensors`` file."""
    index = directory / SAFETENSORS_INDEX
    if not index.is_file():
        shards = sorted(directory.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{directory} has no .safetensors weight files (a config-only directory runs "
                                  "with load_format='dummy': random weights)")
        return shards
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no weight_map naming the shard of each tensor")
    shards = [directory / name for name in dict.fromkeys(weight_map.values())]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise CheckpointError(f"{index} names shard(s) missing from {directory}: {', '.join(missing)}")
    return shards


def _check_safetensors(shard: Path) -> tuple[set[torch.dtype], dict[str, int]]:
    """The floating dtypes ``shard`` stores and each tensor's rows (its first dimension), from its header.
    safetensors checks the header and that the data section covers every tensor: truncation shows up here."""
    try:
        with safe_open(shard, framework="pt") as reader:
            slices = {name: reader.get_slice(name) for name in reader.keys()}
            rows = {name: s.get_shape()[0] for name, s in slices.items() if s.get_shape()}
    except SafetensorError as error:
        raise CheckpointError(f"{shard} is not a readable safetensors file (truncated or corrupt): {error}") from None
    # every tensor is a weight: an integer or boolean one would be cast to values it never held
    if other := sorted((name, s.get_dtype()) for name, s in slices.items()
                       if s.get_dtype() not in SAFETENSORS_FLOAT_DTYPES):
        raise CheckpointError(f"{shard}: tensor {other[0][0]} is stored as {other[0][1]}; kvserve reads weights "
                              f"stored as {', '.join(SAFETENSORS_FLOAT_DTYPES)}")
    return {SAFETENSORS_FLOAT_DTYPES[s.get_dtype()] for s in slices.values()}, rows


def _read_safetensors(
    shards: list[Path], dtype: torch.dtype, keep_quantized: frozenset[int], mapped: bool = False
) -> WeightIterator:
    # no ggml blocks; and mapped or not, safetensors' reader maps the file and hands out views of its pages, which
    # the model keeps (load_format="mmap") or copies into its own parameters
    del keep_quantized, mapped
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as reader:
                for name in reader.keys():
                    yield name, _cast(reader.get_tensor(name), dtype)
        except SafetensorError as error:
            raise CheckpointError(f"{shard}: reading tensors failed (truncated or corrupt): {error}") from None


def _read_hf_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(f"{directory} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer  # see _with_architectures

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (ValueError, OSError, KeyError) as error:
        raise CheckpointError(f"{directory}: transformers cannot load its tokenizer: {error}") from None


# ---- GGUF ------------------------------------------------------------------------------------------------


def _load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
    try:
        index = load_gguf_index(path)
    except (CheckpointError, PermissionError, IsADirectoryError):  # a file not ours to read is not a damaged one
        raise
    except Exception as error:  # the readers fail deep inside numpy or struct on a damaged file
        _check_gguf_architecture(path)  # the clearer error, where that is the cause
        raise CheckpointError(_unreadable_gguf(path, error)) from None
    config = _with_architectures(index.config, path)
    check_config(config, {entry.hf_name: entry.dims[0] for entry in index.tensors if entry.dims}, path)
    return Checkpoint(
        hf_config=config,
        tokenizer=index.tokenizer,
        eos_token_ids=_eos_token_ids(None, config, index.tokenizer, path),
        max_model_len=_max_model_len(config, path),
        read_weights=partial(_read_gguf, path, index, dtype),
        is_gguf=True,
        gguf_matrix_types={entry.name: entry.qtype for entry in index.tensors if len(entry.dims) == 2},
    )


def _check_gguf_architecture(path: Path) -> None:
    """Fail early, from the metadata alone (a fast read), on a file transformers cannot turn into a model."""
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        metadata, _ = read_gguf_metadata(str(path))
    except (PermissionError, IsADirectoryError):
        raise
    except Exception as error:
        raise CheckpointError(_unreadable_gguf(path, error)) from None
    architecture = metadata["general.architecture"]
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        readable = ", ".join(sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}))
        raise CheckpointError(
            f"{path}: transformers cannot read GGUF files of architecture {architecture!r} (it reads {readable})"
        )


def _unreadable_gguf(path: Path, error: Exception) -> str:
    size = path.stat().st_size
    return (f"{path} is not a readable GGUF file (truncated or corrupt, or its metadata is invalid; {size} bytes): "
            f"{type(error).__name__}: {error}")


def _read_gguf(
    path: Path, index: GGUFIndex, dtype: torch.dtype, keep_quantized: frozenset[int] = frozenset(),
    mapped: bool = False,
) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
    """Each tensor under its Hugging Face name: dequantized to ``dtype``, or, for a 2-D tensor whose ggml type
    is in ``keep_quantized``, as the file's blocks (``GGMLTensor``, rows in Hugging Face order; ``mapped``: a
    view of the file's pages, mapped copy-on-write, unless the rows were reordered)."""
    from gguf import GGMLQuantizationType, dequantize

    # transformers' processor undoes llama.cpp's Q/K row permutation (rows are whole block runs, so it applies
    # to blocks as to values) and Gemma's norm offset: as the index learned it (``TensorProcessing``), or run here
    # for a tensor whose processing is something else
    process = partial(_process_gguf_tensor, index)
    for entry, data in index.arrays(path, writable=mapped):
        qtype = GGMLQuantizationType(entry.qtype)
        keep = qtype in keep_quantized and len(entry.dims) == 2
        weights = process(entry, data if keep else dequantize(data, qtype))
        if keep:
            yield entry.hf_name, GGMLTensor.from_numpy(weights, qtype, copy=not mapped)
        else:
            yield entry.hf_name, torch.from_numpy(np.array(weights)).to(dtype)


def _process_gguf_tensor(index: GGUFIndex, entry: TensorEntry, weights: np.ndarray) -> np.ndarray:
    if entry.processing is not None and not (entry.processing.shift and weights.dtype == np.uint8):
        return entry.processing.apply(weights)
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(index.architecture, TensorProcessor)(config=index.config.to_dict())
    return processor.process(weights=weights, name=entry.name, tensor_key_mapping={entry.name: entry.hf_name},
                             parsed_parameters={}).weights


# ---- shared ----------------------------------------------------------------------------------------------


def _with_architectures(config: PretrainedConfig, source: Path) -> PretrainedConfig:
    """Set ``architectures`` (absent from GGUF metadata and some configs) from the model type."""
    # transformers.models and its Auto classes are imported where they are used, never at import: the package's
    # first import reads every model's source files for their ``__all__`` (0.4-0.6 s on 2 cores), and serving a
    # GGUF whose index is cached (the default model) needs none of them
    if not config.architectures:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if architecture is None:
            raise CheckpointError(f"{source}: model type {config.model_type!r} is not a causal LM transformers knows")
        config.architectures = [architecture]
    return config


def _eos_token_ids(generation_eos: Any, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
                   source: Path) -> frozenset[int]:
    """The first source that names any: generation_config.json, then the model config, then the tokenizer;
    CheckpointError naming the source (``source``: the model's directory or file) where that is no token id of
    the vocabulary, nor a list of them: a string was taken for its characters, an id past the vocabulary failed
    every step that asked for min_tokens."""
    vocab_size = config.get_text_config().vocab_size
    for eos, where in ((generation_eos, "generation_config.json"), (getattr(config, "eos_token_id", None), "config"),
                       (tokenizer.eos_token_id, "tokenizer")):
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) else eos
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab_size for i in ids):
            raise CheckpointError(f"{source}: the {where}'s eos_token_id must be a token id, or a list of them, in "
                                  f"[0, {vocab_size}); got {eos!r}")
        return frozenset(ids)
    return frozenset()


def _max_model_len(config: PretrainedConfig, source: Path) -> int:
    max_len = getattr(config, "max_position_embeddings", None)
    if not isinstance(max_len, int) or max_len < 1:
        raise CheckpointError(f"{source}: the config has no valid max_position_embeddings ({max_len!r})")
    return max_len


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ``to`` returns the tensor itself (a view of the mapped file) when it is in ``dtype`` already: no copy
    return tensor.to(dtype) if tensor.is_floating_point() else tensor
