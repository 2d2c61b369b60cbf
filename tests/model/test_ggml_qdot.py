"""The block kernel's int8-activation path: its quantization of x equal bit for bit to the torch twin's, its
products within fp32 rounding of the twin (x quantized, dequantized, times the dequantized weight) for every
block type and ISA build this CPU runs, within the stated bound of the exact path, and chosen by the linear
method for steps of up to its ``max_rows`` rows."""

from __future__ import annotations

import ctypes

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve import native
from kvserve.model.layers import ggml, ggml_qdot
from kvserve.model.layers.ggml import GGMLLinearMethod, GGMLTensor
from kvserve.model.layers.ggml_qdot import (
    ACTIVATION_BLOCK, QDotGemm, activation_error_bound, quantize_activations, reference_qdot_linear,
)
from kvserve.model.layers.linear import Linear, UnquantizedLinearMethod
from tests.model.test_ggml import K_TYPES, TYPES, blocks_of, random_blocks
from tests.isa_builds import cpu_flags


@pytest.fixture(scope="module")
def kernel() -> QDotGemm:
    return QDotGemm()


def random_weight(n: int, k: int, qtype: Q, gen: torch.Generator) -> GGMLTensor:
    if qtype in K_TYPES:
        return random_blocks(n, k, qtype, gen)
    return blocks_of(torch.randn(n, k, generator=gen), qtype)


def assert_equals_the_twin(y: torch.Tensor, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None) -> None:
    """Within fp32 rounding of the twin: the kernel sums integer dots times d * dx per group, the twin
    products of fp32 values, so the bound scales with the terms' magnitudes, |x_q| . |w|."""
    reference = reference_qdot_linear(x, weight, bias)
    scale = quantize_activations(x).dequantize().abs() @ weight.dequantize().abs().T
    assert y.shape == reference.shape
    assert ((y - reference).abs() <= 2e-6 * (scale + (0 if bias is None else bias.abs())) + 1e-6).all(), \
        float((y - reference).abs().max())


def test_the_kernels_quantization_equals_the_twins_bit_for_bit(kernel: QDotGemm) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 160, generator=gen) * torch.logspace(-8, 4, 9).unsqueeze(1)
    x[3, 32:64] = 0  # a block of zeros: scale 0, codes 0
    x[4, :32] = torch.arange(32) - 15.5  # halves: rounded to even
    x[5, 70] = float("nan")  # left out of its block's max, its code 0 (as in llama.cpp)
    ours, twin = kernel.quantize_activations(x), quantize_activations(x)
    for a, b in zip(ours, twin):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert twin.codes.abs().amax() == 127 and (twin.dx[3, 1] == 0 and twin.sx[3, 1] == 0)
    assert twin.codes[5, 70] == 0 and twin.dx[5, 2].isfinite()
    # the stated bound, whatever the twin says: each value moves by at most half its block's step (rounded to the
    # nearest code; truncated codes moved by up to a whole step and both twins agreed)
    step = twin.dx.repeat_interleave(ACTIVATION_BLOCK, dim=1)
    moved = (twin.dequantize() - x).abs()
    finite = x.isfinite()
    assert (moved[finite] <= step[finite] * (0.5 + 1e-6)).all()


def test_the_twin_quantizes_infinities_and_tiny_blocks_as_the_kernel_does(kernel: QDotGemm) -> None:
    """An inf makes its block's dx inf and sx NaN (the product NaN, as the exact path's); a block whose 1 / dx is
    inf has codes 0 and sx 0. The twin once turned the inf into the largest float and gave a finite product."""
    x = torch.linspace(-1, 1, 96).repeat(2, 1)
    x[0, 3] = float("inf")
    x[1, 32:64] *= 1e-37
    ours, twin = kernel.quantize_activations(x), quantize_activations(x)
    for a, b in zip(ours, twin):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert twin.dx[0, 0].isinf() and twin.sx[0, 0].isnan() and twin.sx[1, 1] == 0 and (twin.codes[1, 32:64] == 0).all()


@pytest.mark.parametrize("qtype", TYPES + K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 9, 17, 128])
def test_the_kernel_equals_its_twin_and_stays_within_the_bound(kernel: QDotGemm, qtype: Q, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + int(qtype))
    n, k = (37, 512) if qtype in K_TYPES else (37, 160)  # odd columns: a last tile of one
    weight = random_weight(n, k, qtype, gen)
    x = torch.randn(rows, k + 16, generator=gen)[:, 8 : 8 + k]  # strided rows, as the layers' slices are
    bias = torch.randn(n, generator=gen) if rows % 2 else None
    y = kernel(x, weight, bias)
    assert_equals_the_twin(y, x, weight, bias)
    # the stated bound against the exact path: each x moves by at most dx / 2
    exact = ggml.reference_linear(x, weight, bias)
    fp32 = 2e-6 * (x.abs() @ weight.dequantize().abs().T) + 1e-6
    assert ((y - exact).abs() <= activation_error_bound(x, weight) + fp32).all()


@pytest.mark.parametrize("qtype", TYPES + K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [0, 4, 5, 16, 17, 33, 70])
def test_the_batched_product_equals_the_twin(kernel: QDotGemm, qtype: Q, rows: int) -> None:
    """Past ``max_rows`` the int8 strips kernel: the same numerics (the twin's bound), 37 columns (a last strip
    of a few on every build), whole and partial vectors of rows; into a column range of a wider output, nothing
    written outside it."""
    gen = torch.Generator().manual_seed(rows * 100 + int(qtype))
    k = 512 if qtype in K_TYPES else 160
    weight = random_weight(37, k, qtype, gen)
    x = torch.randn(rows, k + 16, generator=gen)[:, 8 : 8 + k]
    x[:, :32] *= 1e-3  # a block of small values next to large ones: codes of both signs and sizes
    bias = torch.randn(37, generator=gen) if rows % 2 else None
    wide = torch.full((rows, 45), float("nan"))
    kernel.batched(x, weight, bias, out=wide[:, 3:40])
    assert_equals_the_twin(wide[:, 3:40], x, weight, bias)
    assert wide[:, :3].isnan().all() and wide[:, 40:].isnan().all()


def test_the_batched_product_of_extreme_q8_0_bytes_does_not_overflow(kernel: QDotGemm) -> None:
    """Q8_0's quants at -127 and 127 against codes of +-127 everywhere: the largest products each build's dot
    adds (without VNNI, two of them in a saturating int16 unless the sign moves onto the codes)."""
    w = torch.where(torch.arange(64) % 3 == 0, -1.0, 1.0).repeat(24, 1)
    weight = blocks_of(w, Q.Q8_0)
    x = torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0).repeat(20, 1) * torch.linspace(0.5, 2, 20).unsqueeze(1)
    assert_equals_the_twin(kernel.batched(x, weight, None), x, weight, None)


def assert_build_equals_the_twin(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ISA_ENV_VAR, isa)
    build = QDotGemm(ctypes.CDLL(str(native.library_path(ggml_qdot.GGML_QDOT_SOURCE, batch_invariant=False))))
    gen = torch.Generator().manual_seed(1)
    for qtype in TYPES + K_TYPES:
        weight = random_weight(19, 512, qtype, gen)
        for rows in (1, 4, 7):
            x = torch.randn(rows, 512, generator=gen)
            assert_equals_the_twin(build(x, weight, None), x, weight, None)
        for rows in (5, 19):  # the int8 strips kernel
            x = torch.randn(rows, 512, generator=gen)
            assert_equals_the_twin(build.batched(x, weight, None), x, weight, None)


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512vnni", "avxvnni"])
def test_each_isa_build_equals_the_twin(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every build this CPU can run; the others are at least compiled (a VNNI path that does not build fails),
    past the check that refuses them to a process on this CPU."""
    if set(native.ISA_CPU_FLAGS[isa]) <= cpu_flags():
        assert_build_equals_the_twin(isa, monkeypatch)
        return
    monkeypatch.setenv(native.ISA_ENV_VAR, isa)
    monkeypatch.setitem(native.ISA_CPU_FLAGS, isa, ())
    assert native.library_path(ggml_qdot.GGML_QDOT_SOURCE, batch_invariant=False).exists()


def test_without_a_dense_copy_the_linear_method_takes_the_int8_path_at_every_step(kernel: QDotGemm) -> None:
    """As ``--quantize-activations`` loads a GGUF: no dense layout; steps past ``max_rows`` rows take the int8
    strips kernel, the same numerics as the column tiles."""
    gen = torch.Generator().manual_seed(6)
    weight = blocks_of(torch.randn(48, 64, generator=gen), Q.Q4_1)
    layer = Linear(64, 48, bias=False)
    layer.bind(GGMLLinearMethod(ggml.GGMLGemm(), UnquantizedLinearMethod(), kernel, keep_dense=False), torch.float32)
    layer.load_weight("weight", weight)
    layer.process_weights_after_loading()
    assert layer.weight.numel() == 0  # the blocks are the only copy
    for rows in (1, kernel.max_rows, kernel.max_rows + 1, 40):
        x = torch.randn(rows, 64, generator=gen)
        assert_equals_the_twin(layer(x), x, weight, None)


def test_the_linear_method_takes_the_int8_path_up_to_its_row_limit(kernel: QDotGemm) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = blocks_of(torch.randn(48, 64, generator=gen), Q.Q4_1)
    layer = Linear(64, 48, bias=False)
    layer.bind(GGMLLinearMethod(ggml.GGMLGemm(), UnquantizedLinearMethod(), kernel), torch.float32)
    layer.load_weight("weight", weight)
    layer.process_weights_after_loading()
    for rows in (1, kernel.max_rows):
        x = torch.randn(rows, 64, generator=gen)
        assert_equals_the_twin(layer(x), x, weight, None)
    x = torch.randn(kernel.max_rows + 1, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ weight.dequantize().T)


@pytest.mark.parametrize("rows", [2, 20])  # the column tiles, the int8 strips kernel
def test_the_kernel_refuses_what_it_cannot_read(kernel: QDotGemm, rows: int) -> None:
    weight = blocks_of(torch.randn(8, 64), Q.Q8_0)
    with pytest.raises(ValueError, match="does not fit a Q8_0 weight"):
        kernel.batched(torch.randn(rows, 32), weight, None)
    with pytest.raises(ValueError, match="Q2_K"):
        kernel.batched(torch.randn(rows, 64), GGMLTensor(weight.blocks, Q.Q2_K, weight.shape), None)
