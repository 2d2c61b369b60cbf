"""The bench tests drive the same real ``kvserve serve`` process the server tests use, and build workloads with
the tokenizer of its tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from kvserve.model.loader import load_checkpoint
from kvserve.model.sources import resolve_model
from tests.server.conftest import server, start_server, tiny_checkpoint  # noqa: F401  (fixtures)


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint: Path) -> PreTrainedTokenizerBase:  # noqa: F811  (the fixture above)
    return load_checkpoint(resolve_model(str(tiny_checkpoint)), torch.float32).tokenizer
