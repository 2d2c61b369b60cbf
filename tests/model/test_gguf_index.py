"""The GGUF index: parsed once, read back without parsing, rebuilt when unreadable or when the file changes,
and never a reason for a load to fail."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig
from transformers.utils import CONFIG_NAME

from kvserve.model import gguf_index
from kvserve.model.checkpoint import ARCHITECTURES
from kvserve.model.loader import load_checkpoint
from tests.model.test_loader import byte_level_tokens, gguf_location, tiny_llama, write_gguf


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", tiny_llama(vocab_size=len(byte_level_tokens()[0])),
                      qtype=gguf.GGMLQuantizationType.Q8_0)


def load(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    checkpoint = load_checkpoint(gguf_location(path), torch.float32)
    config = checkpoint.hf_config.to_dict()
    del config["_name_or_path"]  # the folder it was read from: the file's, then the index's
    return config, dict(checkpoint.weights())


def test_a_second_load_reads_the_index_without_parsing_the_file(gguf_file: Path, monkeypatch) -> None:
    config, weights = load(gguf_file)
    assert gguf_index._index_dir(gguf_file).stat().st_mode & 0o777 == 0o755  # a cache folder users share

    def no_parse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    monkeypatch.setattr(AutoConfig, "from_pretrained", _refuse_gguf(AutoConfig.from_pretrained))
    again_config, again = load(gguf_file)
    assert again_config == config
    assert again.keys() == weights.keys() and all(torch.equal(again[n], weights[n]) for n in weights)
    tokenizer = load_checkpoint(gguf_location(gguf_file), torch.float32).tokenizer
    assert tokenizer.decode(tokenizer("hi  there")["input_ids"]) == "hi  there"


def _refuse_gguf(from_pretrained):
    def refusing(*args, **kwargs):
        assert "gguf_file" not in kwargs, "the config was read from the GGUF file again"
        return from_pretrained(*args, **kwargs)

    return refusing


def test_an_unreadable_index_is_rebuilt_with_a_warning(gguf_file: Path, caplog) -> None:
    _, weights = load(gguf_file)
    listing = gguf_index._index_dir(gguf_file) / gguf_index.TENSORS_FILE
    listing.write_text(listing.read_text()[:100])  # torn
    with caplog.at_level(logging.WARNING):
        _, again = load(gguf_file)
    assert "rebuilding the unreadable GGUF index" in caplog.text
    assert all(torch.equal(again[n], weights[n]) for n in weights)


@pytest.mark.parametrize("damage", ["tokenizer.json cut short", "chat template gone"])
def test_an_index_with_a_damaged_or_lost_file_is_rebuilt(gguf_file: Path, caplog, damage: str) -> None:
    """tokenizers' parse errors are bare Exceptions: a torn tokenizer.json failed every later load, named as a
    damaged GGUF; a lost template file loaded the model without its chat template."""
    checkpoint = load_checkpoint(gguf_location(gguf_file), torch.float32)
    directory = gguf_index._index_dir(gguf_file)
    if damage == "chat template gone":
        (directory / "chat_template.jinja").unlink()
    else:
        (directory / "tokenizer.json").write_text((directory / "tokenizer.json").read_text()[:100])
    with caplog.at_level(logging.WARNING):
        again = load_checkpoint(gguf_location(gguf_file), torch.float32)
    assert "rebuilding the unreadable GGUF index" in caplog.text
    assert again.tokenizer.chat_template == checkpoint.tokenizer.chat_template is not None


def test_a_file_replaced_with_its_size_and_time_kept_gets_an_index_of_its_own(gguf_file: Path, tmp_path: Path) -> None:
    """As ``cp -p`` and ``rsync -t`` replace it: the old file's index (its config, its offsets) was served."""
    load(gguf_file)
    other = write_gguf(tmp_path / "other.gguf", tiny_llama(vocab_size=len(byte_level_tokens()[0]),
                                                           max_position_embeddings=128),
                       qtype=gguf.GGMLQuantizationType.Q8_0)
    stat = gguf_file.stat()
    assert other.stat().st_size == stat.st_size
    os.replace(other, gguf_file)
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    config, _ = load(gguf_file)
    assert config["max_position_embeddings"] == 128


def test_indexes_unread_for_two_weeks_are_removed_as_another_is_built(gguf_file: Path, tmp_path: Path) -> None:
    load(gguf_file)
    stale = gguf_index._index_dir(gguf_file)
    weeks_ago = time.time() - gguf_index.UNUSED_INDEX_S - 60
    os.utime(stale, (weeks_ago, weeks_ago))
    load(gguf_file)  # read: in use again
    assert time.time() - stale.stat().st_mtime < 60
    os.utime(stale, (weeks_ago, weeks_ago))
    load(write_gguf(tmp_path / "second.gguf", tiny_llama(vocab_size=len(byte_level_tokens()[0]))))
    assert not stale.exists()


def test_a_changed_file_gets_an_index_of_its_own(gguf_file: Path) -> None:
    load(gguf_file)
    before = set(gguf_index.index_root().iterdir())
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    load(gguf_file)
    assert len(set(gguf_index.index_root().iterdir()) - before) == 1


def test_an_unwritable_index_folder_only_costs_a_warning(gguf_file: Path, monkeypatch, caplog) -> None:
    blocker = gguf_file.parent / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(gguf_index, "index_root", lambda: blocker / "index")
    with caplog.at_level(logging.WARNING):
        _, weights = load(gguf_file)
    assert "could not keep the GGUF index" in caplog.text and weights


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_an_indexed_config_reads_back_as_its_class_made_it(tiny_checkpoints, tmp_path: Path, arch: str) -> None:
    config = AutoConfig.from_pretrained(tiny_checkpoints[arch])
    config.to_json_file(tmp_path / CONFIG_NAME, use_diff=False)  # as _write_index saves it
    indexed = gguf_index.IndexedConfig.read(tmp_path / CONFIG_NAME)
    made, read = config.to_dict(), indexed.to_dict()
    del made["_name_or_path"], read["_name_or_path"]
    assert read == made
    assert indexed.model_type == config.model_type and indexed.architectures == config.architectures


# transformers' processor per GGUF architecture of a family kvserve runs, and names it treats apart
PROCESSED_NAMES = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_norm.weight",
                   "blk.0.post_attention_norm.weight", "output_norm.weight", "token_embd.weight"]


@pytest.mark.parametrize("architecture", ["llama", "gemma3", "qwen2", "qwen3"])
@pytest.mark.parametrize("name", PROCESSED_NAMES)
def test_the_learned_processing_equals_transformers_processor(architecture: str, name: str) -> None:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(
        config={"num_attention_heads": 4, "num_key_value_heads": 2})
    processing = gguf_index.learn_processing(processor, name, "hf." + name, 32)
    assert processing is not None
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((32, 24)).astype(np.float32), rng.standard_normal(32).astype(np.float32),
              rng.integers(0, 256, (32, 18), dtype=np.uint8)]  # values, a norm, a tensor's blocks
    for weights in arrays[:2] + (arrays[2:] if not processing.shift else []):
        expected = processor.process(weights=weights, name=name, tensor_key_mapping={}, parsed_parameters={}).weights
        got = processing.apply(weights)
        assert got.dtype == expected.dtype and np.array_equal(got, expected)


class Scaling:
    """A processor that is no row order plus a shift."""

    def process(self, weights, name, **kwargs):
        return SimpleNamespace(weights=weights * 2)


def test_processing_that_is_no_row_order_and_shift_is_not_learned() -> None:
    assert gguf_index.learn_processing(Scaling(), "blk.0.attn_q.weight", "q", 8) is None


def test_a_tensor_without_learned_processing_goes_through_the_processor(gguf_file: Path) -> None:
    _, weights = load(gguf_file)
    directory = gguf_index._index_dir(gguf_file)
    listing = json.loads((directory / gguf_index.TENSORS_FILE).read_text())
    for entry in listing["tensors"]:
        entry["processing"] = None
    (directory / gguf_index.TENSORS_FILE).write_text(json.dumps(listing))
    _, again = load(gguf_file)
    assert again.keys() == weights.keys() and all(torch.equal(again[n], weights[n]) for n in weights)


def test_serving_an_indexed_gguf_imports_no_transformers_model_package(gguf_file: Path) -> None:
    """transformers.models' first import reads every model's sources (0.4-0.6 s of a start)."""
    load(gguf_file)  # the index, built
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from kvserve.model import gguf_index\n"
        f"gguf_index.index_root = lambda: Path({str(gguf_index.index_root())!r})\n"
        "from kvserve.model.loader import load_checkpoint\n"
        "from kvserve.model.sources import ModelLocation\n"
        f"path = Path({str(gguf_file)!r})\n"
        "checkpoint = load_checkpoint(ModelLocation('gguf', path, path.name), torch.float32)\n"
        "assert len(dict(checkpoint.weights())) > 0\n"
        "checkpoint.tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
        "print(sorted(name for name in sys.modules if name.startswith('transformers.models')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_index_keeps_the_added_tokens_where_the_tokenizer_reads_them(gguf_file: Path) -> None:
    """In the tokenizer's config, so that loading it does not parse tokenizer.json in Python for them; the
    tokenizer read back equals the one the GGUF's metadata gave."""
    built = load_checkpoint(gguf_location(gguf_file), torch.float32).tokenizer
    saved = json.loads((gguf_index._index_dir(gguf_file) / gguf_index.TOKENIZER_CONFIG).read_text())
    assert {int(i) for i in saved["added_tokens_decoder"]} == set(built.added_tokens_decoder)
    read = load_checkpoint(gguf_location(gguf_file), torch.float32).tokenizer
    assert read.added_tokens_decoder == built.added_tokens_decoder and read.all_special_ids == built.all_special_ids
    text = "hi  there <|endoftext|>"
    assert read(text)["input_ids"] == built(text)["input_ids"]
    assert read.decode(read(text)["input_ids"]) == built.decode(built(text)["input_ids"])
