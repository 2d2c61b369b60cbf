"""The Triton fused ops against their plain-PyTorch twin in fp32, fp16 and bf16: through Triton's interpreter on
CPU, natively on CUDA where there is one; the fallbacks to the twin; their selection on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA

from kvserve.model.layers.activation import GatedMLP  # noqa: E402
from kvserve.model.layers.fused_ops import TorchFusedOps  # noqa: E402
from kvserve.model.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from kvserve.model.layers.triton_fused_ops import TritonFusedOps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TWIN, FUSED = TorchFusedOps(), TritonFusedOps()
# fp32: summation order only; fp16 / bf16: the kernels round once where the twin rounds after each op
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def make_norm(kind: type[RMSNorm], n: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = kind(n, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(n, seed=seed, dtype=dtype, scale=0.5))
    return norm


def assert_close(fast: torch.Tensor, twin: torch.Tensor) -> None:
    assert fast.shape == twin.shape and fast.dtype == twin.dtype
    tol = TOLERANCE[twin.dtype]
    torch.testing.assert_close(fast.float(), twin.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("rows, n", [(1, 576), (5, 100), (3, 13)])
@pytest.mark.parametrize("mode", ["plain", "residual", "sandwich"])
def test_rms_norm_and_its_residual_add(dtype: torch.dtype, kind: type[RMSNorm], rows: int, n: int, mode: str) -> None:
    norm, x_norm = make_norm(kind, n, dtype, 1), make_norm(kind, n, dtype, 2) if mode == "sandwich" else None
    x = randn(rows, n, seed=3, dtype=dtype)
    residual = None if mode == "plain" else randn(rows, n, seed=4, dtype=dtype)
    twin_residual = None if residual is None else residual.clone()
    out = FUSED.rms_norm(norm, x, residual, x_norm)
    expected = TWIN.rms_norm(norm, x, twin_residual, x_norm)
    assert_close(out, expected)
    if residual is not None:
        assert_close(residual, twin_residual)  # the residual stream updated in place as the twin does


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, num_heads, head_dim", [(1, 12, 64), (5, 3, 24), (4, 11, 128), (2, 1, 2)])
def test_rotary_in_place_on_the_qk_columns_of_a_packed_qkv(dtype: torch.dtype, rows: int, num_heads: int,
                                                           head_dim: int) -> None:
    qkv = randn(rows, num_heads + 2, head_dim, seed=5, dtype=dtype)  # the last 2 heads stand for v: untouched
    angles = randn(rows, 1, head_dim // 2, seed=6, dtype=torch.float32, scale=3.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = qkv.clone()
    TWIN.rotary_(expected[:, :num_heads], cos, sin)
    FUSED.rotary_(qkv[:, :num_heads], cos, sin)
    assert_close(qkv, expected)
    assert torch.equal(qkv[:, num_heads:], expected[:, num_heads:])


def test_rotary_by_one_row_of_cos_and_sin_broadcasts_as_the_twin() -> None:
    """The kernel reads a row of cos / sin a token; one row for every token (a slice of a larger table) goes to the
    twin, which broadcasts it, instead of the kernel reading the table's next rows."""
    qk = randn(3, 2, 8, seed=5, dtype=torch.float32)
    table = randn(4, 1, 4, seed=6, dtype=torch.float32, scale=3.0)
    cos, sin = table.cos()[:1], table.sin()[:1]
    expected = qk.clone()
    TWIN.rotary_(expected, cos, sin)
    FUSED.rotary_(qk, cos, sin)
    assert_close(qk, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, num_heads, head_dim", [(3, 8, 64), (1, 3, 24), (6, 2, 128)])
def test_per_head_norm_in_place(dtype: torch.dtype, rows: int, num_heads: int, head_dim: int) -> None:
    for kind in (RMSNorm, GemmaRMSNorm):
        norm = make_norm(kind, head_dim, dtype, 7)
        qkv = randn(rows, num_heads + 1, head_dim, seed=8, dtype=dtype)
        expected = qkv.clone()
        TWIN.head_rms_norm_(norm, expected[:, :num_heads])
        FUSED.head_rms_norm_(norm, qkv[:, :num_heads])
        assert_close(qkv, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows, n", [(1, 1536), (7, 13), (3, 2500)])
def test_activation_times_up(dtype: torch.dtype, activation: str, rows: int, n: int) -> None:
    mlp = GatedMLP(8, n, activation, bias=False)
    gate_up = randn(rows, 2 * n, seed=9, dtype=dtype, scale=2.0)
    assert_close(FUSED.act_and_mul(mlp, gate_up), TWIN.act_and_mul(mlp, gate_up))


def test_what_the_kernels_do_not_take_goes_to_the_twin() -> None:
    n = 24
    mlp = GatedMLP(8, n, "gelu", bias=False)  # exact GELU: no kernel
    gate_up = randn(3, 2 * n, seed=10, dtype=torch.float32)
    assert torch.equal(FUSED.act_and_mul(mlp, gate_up), TWIN.act_and_mul(mlp, gate_up))
    norm, other = make_norm(RMSNorm, n, torch.float32, 1), RMSNorm(n, eps=1e-3).to(DEVICE)
    x, residual = randn(3, n, seed=11, dtype=torch.float32), randn(3, n, seed=12, dtype=torch.float32)
    twin_residual = residual.clone()
    assert torch.equal(FUSED.rms_norm(norm, x, residual, other), TWIN.rms_norm(norm, x, twin_residual, other))
    strided = randn(3, 2 * n, seed=13, dtype=torch.float32)[:, ::2]  # rows not contiguous
    assert torch.equal(FUSED.rms_norm(norm, strided), TWIN.rms_norm(norm, strided))


def test_cuda_models_get_the_triton_ops() -> None:
    from kvserve.model.registry import select_fused_ops

    assert isinstance(select_fused_ops(torch.device("cuda"), torch.bfloat16), TritonFusedOps)
