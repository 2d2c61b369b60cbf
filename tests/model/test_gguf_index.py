"""The GGUF index: parsed once, read back without parsing, rebuilt when unreadable or when the file changes,
and never a reason for a load to fail."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
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

    def no_parse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    monkeypatch.setattr(gguf_index.AutoConfig, "from_pretrained", _refuse_gguf(gguf_index.AutoConfig.from_pretrained))
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
