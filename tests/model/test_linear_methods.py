"""The linear-method seam: every method against F.linear in float64, the method each device and dtype gets,
packed projections in their rows, a tied head, and a whole model loaded through the seam against plain weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.model.layers.linear import (Linear, LinearMethod, PackedLinear, UnquantizedLinearMethod, WeightShapeError,
                                         linear_from_tensors)
from kvserve.model.layers.mapped import MappedLinearMethod
from kvserve.model.layers.prepacked import CpuPrepackedLinearMethod, SmallGemm, can_prepack
from kvserve.model.layers.prepacked import small_gemm as tuned_small_gemm
from kvserve.model.loader import load_checkpoint
from kvserve.model.registry import build_model, load_model, select_linear_method
from kvserve.model.sources import ModelLocation
from tests.model.conftest import Family, PagedRunner, random_prompt

CPU = torch.device("cpu")
needs_prepack = pytest.mark.skipif(not can_prepack(CPU, torch.float32), reason="this torch build has no oneDNN linear")


def methods() -> dict[str, LinearMethod]:
    found = {"unquantized": UnquantizedLinearMethod(), "mapped": MappedLinearMethod()}
    if can_prepack(CPU, torch.float32):
        found["onednn"] = CpuPrepackedLinearMethod(None)
        found["onednn+panels"] = CpuPrepackedLinearMethod(SmallGemm())  # built on any CPU, tuned or not
    return found


METHODS = methods()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 7, 96, 97, 300])
def test_each_method_computes_the_reference(method: str, bias: bool, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, b = torch.randn(53, 37, generator=gen), torch.randn(53, generator=gen) if bias else None
    x = torch.randn(rows, 37, generator=gen)
    layer = linear_from_tensors(weight, b, METHODS[method])
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_each_method_keeps_leading_dimensions(method: str) -> None:
    gen = torch.Generator().manual_seed(1)
    weight, b = torch.randn(29, 19, generator=gen), torch.randn(29, generator=gen)
    x = torch.randn(3, 5, 19, generator=gen)
    layer = linear_from_tensors(weight, b, METHODS[method])
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (3, 5, 29)
    torch.testing.assert_close(y.double(), F.linear(x.double(), weight.double(), b.double()), atol=1e-4, rtol=1e-4)


def test_fp32_on_cpu_is_prepacked_where_it_can_be_and_the_rest_is_plain() -> None:
    """On CUDA plain weights take Triton's skinny GEMM for decode steps where triton imports."""
    method = select_linear_method(CPU, torch.float32)
    if can_prepack(CPU, torch.float32):
        assert isinstance(method, CpuPrepackedLinearMethod) and method.small is tuned_small_gemm()
    else:
        assert type(method) is UnquantizedLinearMethod
    assert type(select_linear_method(CPU, torch.bfloat16)) is UnquantizedLinearMethod
    cuda = select_linear_method(torch.device("cuda"), torch.float32)
    try:
        from kvserve.model.layers.triton_skinny import TritonSkinnyLinearMethod
    except ImportError:  # without triton, torch's GEMM alone
        assert type(cuda) is UnquantizedLinearMethod
    else:
        assert type(cuda) is TritonSkinnyLinearMethod


@pytest.mark.parametrize("method", METHODS)
def test_packed_shards_land_in_their_rows(method: str) -> None:
    shards = {"a_proj": 3, "b_proj": 5, "c_proj": 2}
    gen = torch.Generator().manual_seed(2)
    weights = {name: torch.randn(size, 11, generator=gen) for name, size in shards.items()}
    biases = {name: torch.randn(size, generator=gen) for name, size in shards.items()}
    layer = PackedLinear(11, shards, bias=True)
    layer.bind(METHODS[method], torch.float32)
    for name in reversed(shards):  # the checkpoint's order is not the packing order
        layer.load_weight("weight", weights[name], shard=name)
        layer.load_weight("bias", biases[name], shard=name)
    if method == "unquantized":
        assert torch.equal(layer.weight, torch.cat(list(weights.values())))
    layer.process_weights_after_loading()
    x = torch.randn(4, 11, generator=gen)
    with torch.no_grad():
        y = layer(x)
    for name, rows in layer.shard_rows().items():
        torch.testing.assert_close(y[:, rows], F.linear(x, weights[name], biases[name]), atol=1e-5, rtol=1e-5)


def test_a_shard_of_the_wrong_shape_is_refused() -> None:
    layer = PackedLinear(11, {"a_proj": 3, "b_proj": 5}, bias=False)
    layer.bind(UnquantizedLinearMethod(), torch.float32)
    with pytest.raises(WeightShapeError, match=r"\[4, 11\].*\[3, 11\]"):
        layer.load_weight("weight", torch.zeros(4, 11), shard="a_proj")


def test_build_model_binds_every_linear_to_the_method(tiny_checkpoints: dict[str, Path]) -> None:
    checkpoint = load_checkpoint(ModelLocation("hf_dir", tiny_checkpoints["qwen3"], "qwen3"), torch.float32)
    method = UnquantizedLinearMethod()
    model = build_model(checkpoint.hf_config, TorchRefBackend(), torch.float32, "cpu", method)
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * model.num_layers + 1 and all(m.method is method for m in layers)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied and a tied LM head
def test_a_model_loaded_through_the_seam_computes_the_plain_logits(
    arch: str, tiny_checkpoints: dict[str, Path], families: dict[str, Family]
) -> None:
    family = families[arch]
    checkpoint = load_checkpoint(ModelLocation("hf_dir", tiny_checkpoints[arch], arch), torch.float32)
    ours = load_model(checkpoint, family.backend, torch.float32, CPU)
    assert type(ours.lm_head.method) is type(select_linear_method(CPU, torch.float32))
    prompt = random_prompt(family.vocab_size, 20, seed=3)
    runners = [PagedRunner(model, family.backend, 1, 64) for model in (ours, family.ours)]  # family.ours: plain
    prefill = [runner.step({0: prompt[:-1]})[0] for runner in runners]
    decode = [runner.step({0: prompt[-1:]})[0] for runner in runners]  # one row: the small-GEMM path, if tuned
    for ours_logits, plain_logits in (prefill, decode):
        torch.testing.assert_close(ours_logits, plain_logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(ours_logits.argmax(-1), plain_logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_computes_the_embeddings_logits(dtype: torch.dtype, tiny_checkpoints: dict[str, Path],
                                                    families: dict[str, Family]) -> None:
    checkpoint = load_checkpoint(ModelLocation("hf_dir", tiny_checkpoints["qwen2"], "qwen2"), dtype)
    model = load_model(checkpoint, families["qwen2"].backend, dtype, CPU)
    assert model.tied
    hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    expected = hidden.double() @ model.embed_tokens.weight.double().T
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits.double(), expected, atol=tolerance, rtol=tolerance)
