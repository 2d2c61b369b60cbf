"""``kvserve.device``: the configuration's dtype and device names as torch's."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import ModelConfig
from kvserve.device import parse_dtype, resolve_device


def test_every_dtype_name_parses_to_its_torch_dtype() -> None:
    assert [parse_dtype(name, "cpu") for name in ("fp32", "bf16", "half", "float16")] == [
        torch.float32, torch.bfloat16, torch.float16, torch.float16]
    assert (parse_dtype("auto", "cpu"), parse_dtype("auto", "cuda:1")) == (torch.float32, torch.bfloat16)
    assert parse_dtype(torch.bfloat16, "cpu") is torch.bfloat16


def test_unknown_names_are_refused_by_the_configuration_and_the_parser_alike() -> None:
    message = "unknown dtype 'fp64'; expected one of auto, bf16, bfloat16, float16, float32, fp16, fp32, half"
    for refuse in (lambda: parse_dtype("fp64", "cpu"), lambda: ModelConfig(dtype="fp64")):
        with pytest.raises(ValueError) as error:
            refuse()
        assert str(error.value) == message
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    assert resolve_device("cpu") == "cpu"
