"""GGUFIndex: what a GGUF file's metadata yields (config, tokenizer, and where each tensor lies under which
Hugging Face name), parsed once and kept in the model cache.

gguf's reader parses every metadata field element by element through numpy, so a 49k-token vocabulary takes
seconds, and transformers parses the file again for the config, for the tokenizer and for the weights (and
builds its tensor-name map once per submodule): about 30 s before the default model's first weight is read on
2 cores. The tensor table is read by ``gguf_table`` (the metadata stepped over, not parsed); transformers still
parses the file for the config (18 s for Gemma 3 on a slow CPU, Zen 3). The index is written by those readers
on first use, atomically (synced before it is renamed into place), under a key made of the file's path, size,
modification time, inode and change time and the readers' versions, and read back in milliseconds afterwards;
tensors then come straight from a memory map of the file. An index that cannot be read is rebuilt with a warning;
one no process has read for two weeks is removed when another is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from transformers import PretrainedConfig, PreTrainedTokenizerBase, TokenizersBackend
from transformers.utils import CONFIG_NAME

from kvserve.model.base import CheckpointError
from kvserve.model.config_check import check_layer_count, num_gguf_blocks
from kvserve.model.gguf_metadata import ROPE_FREQS_TENSOR, apply_gguf_settings
from kvserve.model.gguf_table import GGUFTable, GGUFTensor, read_tensor_table
from kvserve.model.packaged import cache_dir

logger = logging.getLogger(__name__)

# bump when the layout below changes (2: the config saved whole, read without its class; 3: with its architectures
# and each tensor's processing; 4: the added tokens in the tokenizer's config)
INDEX_VERSION = 6  # 5: the files an index holds listed in it; 6: the settings transformers leaves out applied
UNUSED_INDEX_S = 14 * 24 * 3600
TENSORS_FILE = "tensors.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor: its GGUF and Hugging Face names, ggml type, and its array as gguf's reader shapes it (blocks
    as uint8 rows of bytes, float types as themselves) at ``offset`` bytes into the file."""

    name: str
    hf_name: str
    qtype: int
    dims: tuple[int, ...]
    dtype: str  # numpy's dtype string of the array
    offset: int
    processing: TensorProcessing | None = None  # None: what transformers' processor does is no row order + shift

    def array(self, data: np.ndarray) -> np.ndarray:
        """The tensor's array inside ``data``, the whole file mapped as uint8 (a view, not a copy)."""
        dtype = np.dtype(self.dtype)
        count = int(np.prod(self.dims))
        return np.frombuffer(data, dtype, count, self.offset).reshape(self.dims)


@dataclass(frozen=True)
class TensorProcessing:
    """What transformers' GGUF tensor processor does to one tensor, when that is rows put in another order and
    a constant added (all it does to the families kvserve runs: llama.cpp's Q/K row permutation undone, Gemma's
    norm offset), learned at index build by running the processor on probe arrays (``learn_processing``).
    Applied from the index, a start needs no processor, whose module imports every transformers model's
    tokenizer registry (0.4-0.6 s on 2 cores)."""

    rows: tuple[int, ...] | None = None  # the source row of each row; None: as stored
    shift: float = 0.0  # added to every value (dequantized values only: never to blocks)

    def apply(self, weights: np.ndarray) -> np.ndarray:
        if self.rows is not None:
            weights = weights[list(self.rows)]
        return weights + np.float32(self.shift) if self.shift else weights


def learn_processing(processor: Any, name: str, hf_name: str, num_rows: int) -> TensorProcessing | None:
    """``processor``'s effect on tensor ``name`` of ``num_rows`` rows as a row order and a shift, from two probes
    of distinct float64 rows; None when it is something else (the loader then runs the processor itself)."""
    probes = [np.arange(num_rows, dtype=np.float64)[:, None], 3.0 * np.arange(num_rows)[:, None] + 5.0]
    try:
        outputs = [np.asarray(processor.process(weights=probe, name=name, tensor_key_mapping={name: hf_name},
                                                parsed_parameters={}).weights) for probe in probes]
    except (ValueError, TypeError, IndexError):
        return None
    first = outputs[0]
    if first.shape != probes[0].shape:
        return None
    shift = float(first.min())
    rows = np.rint(first[:, 0] - shift).astype(np.int64)
    if sorted(rows.tolist()) != list(range(num_rows)):
        return None
    processing = TensorProcessing(None if np.array_equal(rows, np.arange(num_rows)) else tuple(rows.tolist()), shift)
    if not all(np.array_equal(processing.apply(probe), output) for probe, output in zip(probes, outputs)):
        return None
    return processing


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str  # the file's general.architecture, which picks transformers' tensor processor
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    tensors: tuple[TensorEntry, ...]

    def arrays(self, path: Path, writable: bool = False) -> Iterator[tuple[TensorEntry, np.ndarray]]:
        """Each tensor's array in ``path`` mapped read-only, or copy-on-write if ``writable`` (numpy's and torch's
        views of it may then be made without a copy; kvserve never writes to them)."""
        data = np.memmap(path, np.uint8, "c" if writable else "r")
        for entry in self.tensors:
            yield entry, entry.array(data)


def load_gguf_index(path: Path) -> GGUFIndex:
    """The index of ``path`` from the model cache, built there first if it is missing or unreadable. Raises
    whatever the readers raise on a damaged file (the loader turns it into a CheckpointError)."""
    directory = _index_dir(path)
    if directory.is_dir():
        try:
            index = _read_index(directory)
        except Exception as error:  # whatever its readers raise (tokenizers' own parse errors are bare Exceptions)
            logger.warning("rebuilding the unreadable GGUF index %s: %s", directory, error)
            shutil.rmtree(directory, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):  # another user's index in a shared cache: read, not marked
                os.utime(directory)  # in use: kept from ``_remove_unused_indexes``
            return index
    index = _build_index(path)
    _write_index(index, directory)
    _remove_unused_indexes(directory.parent)
    return index


def index_root() -> Path:
    """Where indexes are kept: beside the pulled models."""
    return cache_dir() / ".gguf-index"


def _index_dir(path: Path) -> Path:
    """The index's folder, keyed by the file as the filesystem knows it (a file replaced in place with its size
    and modification time kept, as ``cp -p`` and ``rsync -t`` leave it, is a new inode or a new change time) and
    by the readers that built the index."""
    stat = path.stat()
    key = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns,
                      INDEX_VERSION, transformers.__version__, tokenizers.__version__,
                      getattr(gguf, "__version__", "")])
    return index_root() / hashlib.sha256(key.encode()).hexdigest()[:32]


def _remove_unused_indexes(root: Path) -> None:
    """Remove the indexes no process has read for ``UNUSED_INDEX_S`` (each read sets its folder's modification
    time): each re-pulled, moved or replaced file, and each upgrade of the readers, left one for good (Gemma 3's
    holds 33 MB)."""
    now = time.time()
    try:
        folders = list(root.iterdir())
    except OSError:  # no folder to keep indexes in (``_write_index`` said why)
        return
    for folder in folders:
        with contextlib.suppress(OSError):
            if folder.is_dir() and now - folder.stat().st_mtime > UNUSED_INDEX_S:
                shutil.rmtree(folder)


def _build_index(path: Path) -> GGUFIndex:
    # transformers.models only here (loader._with_architectures says why)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # Not AutoTokenizer: it parses the whole file again with the slow legacy reader only to pick a class; the
    # tokenizer it then builds from the metadata is this same one.
    tokenizer = TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)
    table = read_tensor_table(path)
    # before the meta model, which has as many layers as the metadata says (a million took minutes)
    check_layer_count(config.num_hidden_layers, num_gguf_blocks(t.name for t in table.tensors), path,
                      f"{table.architecture}.block_count")
    try:
        apply_gguf_settings(config, table, _rope_factors(table, path))
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from None
    processor = TENSOR_PROCESSORS.get(table.architecture, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):  # the name map comes from a model that costs no memory
        model = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(model, processor)
    # kept in the index, so that a start from it needs no mapping of model types to classes (GGUF metadata
    # names none)
    config.architectures = config.architectures or [type(model).__name__]
    size = path.stat().st_size
    unnamed = [t.name for t in table.tensors if t.name not in names and t.name != ROPE_FREQS_TENSOR]
    if unnamed:  # a tensor the model would not read changes what it computes: never dropped unsaid
        raise CheckpointError(f"{path}: tensors no {table.architecture} model of transformers' reads: "
                              f"{', '.join(unnamed[:8])}{' ...' if len(unnamed) > 8 else ''}")
    tensors = tuple(_entry(t, names[t.name], processor, path, size) for t in table.tensors if t.name in names)
    return GGUFIndex(table.architecture, config, tokenizer, tensors)


def _rope_factors(table: GGUFTable, path: Path) -> list[float] | None:
    """The values of the file's ``rope_freqs.weight`` (one F32 factor per rope frequency), if it has one."""
    tensor = next((t for t in table.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if tensor is None:
        return None
    if tensor.qtype != 0 or len(tensor.shape) != 1:
        raise CheckpointError(f"{path}: {ROPE_FREQS_TENSOR} is not a vector of F32 factors")
    with open(path, "rb") as file:
        file.seek(tensor.offset)
        data = file.read(4 * tensor.shape[0])
    if len(data) != 4 * tensor.shape[0]:
        raise CheckpointError(f"{path}: {ROPE_FREQS_TENSOR} runs past the end of the file")
    return np.frombuffer(data, dtype="<f4").tolist()


# ggml types held as values, as numpy reads them; every other type is rows of blocks, read as bytes
_VALUE_TYPES = {0: np.float32, 1: np.float16}  # (gguf dequantizes no other: I8 ... F64 are refused)


@functools.cache
def _dequantizable(qtype: int) -> bool:
    """Whether gguf dequantizes ``qtype`` (tried on one zero block: it has no list to ask)."""
    quantization = gguf.GGMLQuantizationType(qtype)
    try:
        gguf.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[quantization][1]), np.uint8), quantization)
    except NotImplementedError:
        return False
    return True


def _entry(tensor: GGUFTensor, hf_name: str, processor: Any, path: Path, file_size: int) -> TensorEntry:
    """``tensor``'s entry, its array shaped as gguf's reader shapes it: values as themselves, blocks as each row's
    bytes. ValueError where it lies past the file's end (a file cut short); CheckpointError where it is of a type
    the loader cannot turn into values."""
    if not _dequantizable(tensor.qtype):  # the file is sound: said as it is, not as a damaged one
        raise CheckpointError(f"{path}: tensor {tensor.name} is of ggml type "
                              f"{gguf.GGMLQuantizationType(tensor.qtype).name}, which kvserve cannot read (the gguf "
                              "package does not dequantize it)")
    if tensor.qtype in _VALUE_TYPES:
        dims, dtype = tensor.shape, np.dtype(_VALUE_TYPES[tensor.qtype])
    else:
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.qtype)]
        if tensor.shape[-1] % block_values:
            raise ValueError(f"{path}: tensor {tensor.name}'s rows of {tensor.shape[-1]} values are no whole number "
                             f"of {block_values}-value blocks")
        dims, dtype = (*tensor.shape[:-1], tensor.shape[-1] // block_values * block_bytes), np.dtype(np.uint8)
    if tensor.offset + math.prod(dims) * dtype.itemsize > file_size:  # Python's ints: no product wraps
        raise ValueError(f"{path} is cut short: tensor {tensor.name} runs past its {file_size} bytes")
    return TensorEntry(tensor.name, hf_name, tensor.qtype, tuple(dims), dtype.str, tensor.offset,
                       learn_processing(processor, tensor.name, hf_name, dims[0]))


def _write_index(index: GGUFIndex, directory: Path) -> None:
    """Write the index whole into a fresh folder, then rename it into place: a reader sees all of it or none.
    A folder that cannot be written only costs the next start its parse."""
    staging = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".tmp-"))
        # every attribute, not save_pretrained's difference from the defaults: IndexedConfig has no defaults of its own
        index.config.to_json_file(staging / CONFIG_NAME, use_diff=False)
        index.tokenizer.save_pretrained(staging)
        _keep_added_tokens(staging / TOKENIZER_CONFIG, index.tokenizer)
        entries = [dataclasses.asdict(entry) for entry in index.tensors]
        files = sorted(p.name for p in staging.iterdir())  # what a read must find (a chat template's file too)
        (staging / TENSORS_FILE).write_text(json.dumps({"architecture": index.architecture, "tensors": entries,
                                                        "files": files}))
        _synced(staging)
        staging.chmod(0o755)  # readable by whoever shares the cache folder (mkdtemp's is the owner's alone)
        os.replace(staging, directory)
    except OSError as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not directory.is_dir():  # else another process has just written the same index
            logger.warning("could not keep the GGUF index in %s (%s); the next start parses the file again",
                           directory, error)


def _synced(folder: Path) -> None:
    """Every file of ``folder`` and the folder itself on the disk before it is renamed into place: after a crash a
    renamed folder of empty files would be read as an index."""
    for file in folder.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _keep_added_tokens(config_file: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Write the added tokens into the tokenizer's config as transformers reads them back there: without them,
    loading the tokenizer parses the whole tokenizer.json in Python only to take its added tokens (0.2 s of a
    start for the default model's 3.5 MB, 0.9 s for Gemma 3's 33 MB)."""
    config = json.loads(config_file.read_bytes())
    added = tokenizer.added_tokens_decoder
    config["added_tokens_decoder"] = {str(i): token.__getstate__() for i, token in added.items()}
    config_file.write_text(json.dumps(config, indent=2), encoding="utf-8")


def _read_index(directory: Path) -> GGUFIndex:
    listing = json.loads((directory / TENSORS_FILE).read_bytes())
    if missing := sorted(set(listing["files"]) - {p.name for p in directory.iterdir()}):
        raise FileNotFoundError(f"the index has lost {', '.join(missing)}")
    tensors = tuple(
        TensorEntry(e["name"], e["hf_name"], e["qtype"], tuple(e["dims"]), e["dtype"], e["offset"],
                    _read_processing(e["processing"]))
        for e in listing["tensors"]
    )
    config = IndexedConfig.read(directory / CONFIG_NAME)
    tokenizer = TokenizersBackend.from_pretrained(directory)
    return GGUFIndex(listing["architecture"], config, tokenizer, tensors)


def _read_processing(saved: dict[str, Any] | None) -> TensorProcessing | None:
    if saved is None:
        return None
    rows = saved["rows"]
    return TensorProcessing(None if rows is None else tuple(rows), float(saved["shift"]))


class IndexedConfig(PretrainedConfig):
    """An index's config read back as it was saved: every attribute the architecture's own config class gave it
    when the index was built (defaults filled in, values validated), without importing that class. In transformers 5
    a model's configuration module imports its type validators, which import the activations, the hub kernels and
    accelerate (and boto3): reading the default model's index took 1.2 s with that import, 0.37 s without (2 cores,
    Emerald Rapids)."""

    @classmethod
    def read(cls, path: Path) -> IndexedConfig:
        saved = json.loads(path.read_bytes())
        config = cls.from_dict(saved)
        for key, value in saved.items():  # what the base class's constructor sets aside (use_cache)
            if key not in vars(config):
                setattr(config, key, value)
        return config

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output["model_type"] = self.model_type  # the saved one (the base class's is empty)
        return output
