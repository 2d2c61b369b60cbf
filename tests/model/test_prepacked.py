"""PrepackedLinear against nn.Linear, and a whole model prepacked against the same model unpacked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers.prepacked import PrepackedLinear, can_prepack, prepack_linears
from tests.model.conftest import Family, load_ours

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 7, 64])
def test_prepacked_linear_equals_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 40, bias=bias)
    x = torch.randn(rows, 128, generator=gen)[:, 16:112]  # a strided view, as the layers' slices are
    packed = PrepackedLinear(linear.weight, linear.bias)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
    assert (packed.in_features, packed.out_features) == (96, 40)


def test_only_fp32_on_cpu_is_prepacked() -> None:
    assert not can_prepack(torch.device("cpu"), torch.bfloat16)
    assert not can_prepack(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied and a tied LM head
def test_a_prepacked_model_computes_what_it_did(arch: str, tiny_checkpoints: dict[str, Path],
                                                families: dict[str, Family]) -> None:
    family = families[arch]
    model = load_ours(tiny_checkpoints[arch], family.ours.backend)
    num_linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    embeddings = model.embed_tokens.weight.clone()
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model.compute_logits(hidden)
        assert prepack_linears(model) == num_linears
        after = model.compute_logits(hidden)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(model.embed_tokens.weight, embeddings)  # a tied head is packed into a copy of its own
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
