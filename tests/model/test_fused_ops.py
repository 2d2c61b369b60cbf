"""The CPU fused-op kernels against their plain-PyTorch twin and float64, on odd shapes, built for this CPU and for
AVX2; and their selection for fp32 on CPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvserve.model.layers.activation import GatedMLP
from kvserve.model.layers.cpu_fused_ops import FUSED_OPS_SOURCE, CpuFusedOps
from kvserve.model.layers.fused_ops import TorchFusedOps, UsesFusedOps
from kvserve.model.layers.norm import GemmaRMSNorm, RMSNorm
from kvserve.model.registry import build_model, select_fused_ops
from tests.isa_builds import isa_build
from tests.model.conftest import Family, PagedRunner, random_prompt

TWIN = TorchFusedOps()
ATOL, RTOL = 2e-5, 2e-5
NORM_SHAPES = [(1, 576), (3, 13), (17, 37), (5, 100), (2, 1)]
ROTARY_SHAPES = [(1, 12, 64), (5, 3, 24), (33, 4, 16), (3, 2, 10), (2, 1, 2)]  # rows, q + k heads, head_dim
ACT_SHAPES = [(1, 1536), (7, 13), (19, 100), (2, 3)]


@pytest.fixture(scope="module", params=["native", "avx2"])
def fused(request: pytest.FixtureRequest) -> CpuFusedOps:
    return CpuFusedOps(isa_build(FUSED_OPS_SOURCE, request.param))


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _norm(kind: type[RMSNorm], n: int, seed: int) -> RMSNorm:
    norm = kind(n, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(_randn(n, seed=seed, scale=0.5))
    return norm


def _norm64(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt() * (norm.weight.double() + norm.weight_offset)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a slice of wider rows, as the layers' inputs often are."""
    wide = torch.full((x.shape[0], x.shape[1] + 7), float("nan"))
    wide[:, 3 : 3 + x.shape[1]] = x
    return wide[:, 3 : 3 + x.shape[1]]


@pytest.mark.parametrize("kind", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize(("rows", "n"), NORM_SHAPES)
def test_rms_norm_equals_twin_and_float64(rows: int, n: int, kind: type[RMSNorm], fused: CpuFusedOps) -> None:
    norm, x = _norm(kind, n, seed=n), _strided(_randn(rows, n, seed=rows, scale=3.0))
    expected = _norm64(norm, x)
    torch.testing.assert_close(fused.rms_norm(norm, x).double(), expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused.rms_norm(norm, x), TWIN.rms_norm(norm, x), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("sandwich", [False, True])
@pytest.mark.parametrize("kind", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize(("rows", "n"), NORM_SHAPES)
def test_residual_add_and_norm_equal_twin_and_float64(rows: int, n: int, kind: type[RMSNorm], sandwich: bool,
                                                      fused: CpuFusedOps) -> None:
    norm, x_norm = _norm(kind, n, seed=n), _norm(kind, n, seed=n + 1) if sandwich else None
    x, residual = _strided(_randn(rows, n, seed=rows, scale=2.0)), _randn(rows, n, seed=rows + 1, scale=4.0)
    new_residual = residual.double() + (x.double() if x_norm is None else _norm64(x_norm, x))
    twin_residual, fused_residual = residual.clone(), residual.clone()
    twin_out = TWIN.rms_norm(norm, x, twin_residual, x_norm)
    fused_out = fused.rms_norm(norm, x, fused_residual, x_norm)
    torch.testing.assert_close(fused_residual.double(), new_residual, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused_out.double(), _norm64(norm, new_residual), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused_residual, twin_residual, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused_out, twin_out, atol=ATOL, rtol=RTOL)


def _rope(rows: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = _randn(rows, 1, head_dim // 2, seed=seed, scale=10.0)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize(("rows", "num_heads", "head_dim"), ROTARY_SHAPES)
def test_rotary_in_place_equals_twin_and_float64(rows: int, num_heads: int, head_dim: int, fused: CpuFusedOps) -> None:
    """q and k rotated inside packed qkv rows; v, after them, untouched."""
    qkv = _randn(rows, (num_heads + 1) * head_dim, seed=rows)
    cos, sin = _rope(rows, head_dim, seed=head_dim)
    x1, x2 = qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim).double().chunk(2, dim=-1)
    c, s = cos.double(), sin.double()
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    twin_qkv, fused_qkv = qkv.clone(), qkv.clone()
    for ops, packed in ((TWIN, twin_qkv), (fused, fused_qkv)):
        ops.rotary_(packed[:, : num_heads * head_dim].view(rows, num_heads, head_dim), cos, sin)
    fused_qk = fused_qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim)
    torch.testing.assert_close(fused_qk.double(), expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused_qkv, twin_qkv, atol=ATOL, rtol=RTOL)
    assert torch.equal(fused_qkv[:, num_heads * head_dim :], qkv[:, num_heads * head_dim :])


@pytest.mark.parametrize("kind", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize(("rows", "num_heads", "head_dim"), ROTARY_SHAPES)
def test_head_norm_in_place_equals_twin_and_float64(rows: int, num_heads: int, head_dim: int, kind: type[RMSNorm],
                                                    fused: CpuFusedOps) -> None:
    """The q heads of packed qkv rows normalized in place, each head on its own; the k and v after them
    untouched."""
    norm = _norm(kind, head_dim, seed=head_dim)
    qkv = _randn(rows, (num_heads + 2) * head_dim, seed=rows, scale=3.0)
    expected = _norm64(norm, qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim))
    twin_qkv, fused_qkv = qkv.clone(), qkv.clone()
    for ops, packed in ((TWIN, twin_qkv), (fused, fused_qkv)):
        ops.head_rms_norm_(norm, packed.view(rows, num_heads + 2, head_dim)[:, :num_heads])
    fused_q = fused_qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim)
    torch.testing.assert_close(fused_q.double(), expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused_qkv, twin_qkv, atol=ATOL, rtol=RTOL)
    assert torch.equal(fused_qkv[:, num_heads * head_dim :], qkv[:, num_heads * head_dim :])


def _gelu_tanh64(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


ACTIVATIONS_64 = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh64}


@pytest.mark.parametrize("activation", ACTIVATIONS_64)
@pytest.mark.parametrize(("rows", "n"), ACT_SHAPES)
def test_act_and_mul_equals_twin_and_float64(rows: int, n: int, activation: str, fused: CpuFusedOps) -> None:
    mlp = GatedMLP(8, n, activation, bias=False)
    gate_up = _strided(_randn(rows, 2 * n, seed=n, scale=4.0))
    # gates at the exponential's clamped ends, and past them (x / (1 + exp(-a)) with exp(-a) held at 2e38 gave
    # -0.45 for silu(-1e38); gelu's cube overflows at -1e13)
    gate_up[0, : min(n, 5)] = torch.tensor([-100.0, 100.0, 0.0, -1e38, -1e13])[:n]
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = ACTIVATIONS_64[activation](gate) * up
    torch.testing.assert_close(fused.act_and_mul(mlp, gate_up).double(), expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused.act_and_mul(mlp, gate_up), TWIN.act_and_mul(mlp, gate_up), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_rows_do_not_depend_on_the_rest_of_the_step(num_threads: int, fused: CpuFusedOps) -> None:
    """Each row is computed alone, whatever the thread split: batching must not change a request's logits."""
    norm, mlp = _norm(RMSNorm, 576, seed=0), GatedMLP(8, 1536, "silu", bias=False)
    x, residual, gate_up = _randn(64, 576, seed=1), _randn(64, 576, seed=2), _randn(64, 3072, seed=3)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        whole = fused.rms_norm(norm, x, residual.clone()), fused.act_and_mul(mlp, gate_up)
        alone = [(fused.rms_norm(norm, x[i : i + 1], residual[i : i + 1].clone()),
                  fused.act_and_mul(mlp, gate_up[i : i + 1])) for i in range(64)]
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(whole[0], torch.cat([a for a, _ in alone]))
    assert torch.equal(whole[1], torch.cat([b for _, b in alone]))


def test_what_the_kernels_do_not_take_goes_to_the_twin(fused: CpuFusedOps) -> None:
    norm, mlp = _norm(RMSNorm, 16, seed=0), GatedMLP(8, 5, "gelu", bias=False)  # gelu: erf, not in the kernel
    heads = _randn(3, 4, 16, seed=1)[:, 1:3]  # a 3-D view: not rows
    gate_up = _randn(3, 10, seed=2)
    torch.testing.assert_close(fused.rms_norm(norm, heads), TWIN.rms_norm(norm, heads))
    scattered = _randn(3, 4, 32, seed=3)[:, :, :16]  # heads not one after another
    twin_scattered = scattered.clone()
    fused.head_rms_norm_(norm, scattered)
    TWIN.head_rms_norm_(norm, twin_scattered)
    torch.testing.assert_close(scattered, twin_scattered)
    torch.testing.assert_close(fused.act_and_mul(mlp, gate_up), TWIN.act_and_mul(mlp, gate_up))
    empty = torch.empty(0, 16)
    assert fused.rms_norm(norm, empty, empty.clone()).shape == (0, 16)


def test_fp32_on_cpu_selects_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(select_fused_ops(torch.device("cpu"), torch.float32), CpuFusedOps)
    assert type(select_fused_ops(torch.device("cpu"), torch.bfloat16)) is TorchFusedOps
    # CUDA takes the Triton kernels (tests/model/test_triton_fused_ops.py), the twin where triton is missing
    monkeypatch.setitem(sys.modules, "kvserve.model.layers.triton_fused_ops", None)  # its import then fails
    assert type(select_fused_ops(torch.device("cuda"), torch.float32)) is TorchFusedOps


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # a plain and a sandwich-norm, gelu-tanh family
def test_a_fused_model_computes_what_the_twin_model_does(arch: str, tiny_checkpoints: dict[str, Path],
                                                         families: dict[str, Family]) -> None:
    """The families' models (the ones compared with transformers) have every norm, attention and MLP on the
    kernels, and give the twin's logits on a prefill step and a decode step."""
    family = families[arch]
    assert all(isinstance(m.ops, CpuFusedOps) for m in family.ours.modules() if isinstance(m, UsesFusedOps))
    twin = build_model(family.ours.config, family.backend, torch.float32, "cpu")
    twin.load_weights(load_file(tiny_checkpoints[arch] / "model.safetensors").items())
    assert all(type(m.ops) is TorchFusedOps for m in twin.modules() if isinstance(m, UsesFusedOps))
    prompt = random_prompt(family.vocab_size, 21, seed=0)
    logits = []
    for model in (family.ours, twin.eval()):
        runner = PagedRunner(model, family.backend, num_seqs=1, max_len=64)
        logits.append(torch.cat([runner.step({0: prompt[:20]})[0], runner.step({0: prompt[20:]})[0]]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
