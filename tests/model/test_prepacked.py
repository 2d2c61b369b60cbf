"""The CPU prepacked linear method and the small-GEMM kernel against nn.Linear, and a whole model prepacked against
the same model unpacked."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from kvserve import native
from kvserve.model.layers import prepacked
from kvserve.model.layers.linear import Linear, linear_from_tensors
from kvserve.model.layers.prepacked import CpuPrepackedLinearMethod, SmallGemm, can_prepack
from kvserve.model.registry import build_model, process_weights_after_loading
from tests.isa_builds import cpu_flags
from tests.model.conftest import Family, load_ours

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN linear")


@pytest.fixture(scope="module")
def small() -> SmallGemm:
    return SmallGemm()  # built on any CPU; whether the engine uses it is small_gemm()'s call


@pytest.mark.parametrize("with_small_gemm", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 96, 97, 300])
def test_prepacked_linear_equals_linear(rows: int, bias: bool, with_small_gemm: bool, small: SmallGemm) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 40, bias=bias)  # 40 columns: a full panel and a padded one
    x = torch.randn(rows, 128, generator=gen)[:, 16:112]  # a strided view, as the layers' slices are
    method = CpuPrepackedLinearMethod(small if with_small_gemm else None)
    packed = linear_from_tensors(linear.weight, linear.bias, method)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
    assert (packed.in_features, packed.out_features) == (96, 40)


@pytest.mark.parametrize("with_small_gemm", [False, True])
def test_prepacked_linear_keeps_leading_dimensions(with_small_gemm: bool, small: SmallGemm) -> None:
    linear = nn.Linear(24, 40)
    x = torch.randn(3, 4, 24, generator=torch.Generator().manual_seed(0))
    method = CpuPrepackedLinearMethod(small if with_small_gemm else None)
    packed = linear_from_tensors(linear.weight, linear.bias, method)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (31, 5), (32, 64), (33, 64), (200, 17)])
@pytest.mark.parametrize("rows", [1, 3, 6, 8, 9, 13, 16, 32, 97])
def test_small_gemm_equals_matmul(n: int, k: int, rows: int, small: SmallGemm) -> None:
    _check_small_gemm(small, n, k, rows)


def _check_small_gemm(small: SmallGemm, n: int, k: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(n * k + rows)
    weight, bias, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(rows, k, generator=gen)
    expected = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(small(x, small.pack(weight), bias, n).double(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(small(x, small.pack(weight), None, n).double(), expected - bias.double(),
                               atol=1e-4, rtol=1e-4)


def test_small_gemm_rows_do_not_depend_on_the_rest_of_the_step(small: SmallGemm) -> None:
    """A request's logits must not change with what it is batched with (seeded sampling relies on it)."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(100, 64, generator=gen), torch.randn(300, 64, generator=gen)
    panels = small.pack(weight)
    alone = torch.cat([small(x[i:i + 1], panels, None, 100) for i in range(len(x))])
    assert torch.equal(small(x, panels, None, 100), alone)


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="this CPU has no AVX2 + FMA to run the AVX2 build")
@pytest.mark.parametrize("vendor, max_rows", [("AuthenticAMD", None), ("GenuineIntel", 128), ("", 128)])
def test_the_avx2_build_asked_for_on_any_cpu_equals_matmul(monkeypatch: pytest.MonkeyPatch, vendor: str,
                                                           max_rows: int | None) -> None:
    monkeypatch.setenv(native.ISA_ENV_VAR, "avx2")
    avx2 = SmallGemm(ctypes.CDLL(str(native.library_path(prepacked.SMALL_GEMM_SOURCE))), vendor)
    assert avx2.panel_width == 16 and avx2.tuned and avx2.isa == "avx2"
    for n, k, rows in [(33, 64, 1), (200, 17, 6), (17, 5, 13), (100, 64, 97), (40, 24, 600)]:
        _check_small_gemm(avx2, n, k, rows)
    # on AMD's cores oneDNN's AVX2 kernels are slower at every step size: the panels serve them all and no oneDNN
    # copy is made; on Intel's oneDNN takes steps of more than 128 tokens
    assert avx2.max_rows == max_rows
    linear = nn.Linear(96, 40)
    packed = linear_from_tensors(linear.weight, linear.bias, CpuPrepackedLinearMethod(avx2))
    assert (packed.packed_weight is None) == (max_rows is None)
    for rows in (150, 700):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa, vendor, family, max_rows", [
    ("avx512", "AuthenticAMD", 26, None), ("avx512", "AuthenticAMD", 27, None), ("avx512", "AuthenticAMD", 25, 96),
    ("avx512", "GenuineIntel", 6, 96), ("avx512", "", 0, 96), ("avx2", "AuthenticAMD", 23, None),
    ("avx2", "GenuineIntel", 6, 128), ("generic", "AuthenticAMD", 26, 96)])
def test_the_panels_serve_steps_up_to_the_measured_crossover_of_each_cpu(isa: str, vendor: str, family: int,
                                                                          max_rows: int | None) -> None:
    """Zen 5's full-width AVX-512 panels beat oneDNN at every step size, Zen 4's and Intel's not above 96 rows."""
    assert prepacked.max_panel_rows(isa, vendor, family) == max_rows


@pytest.mark.skipif(not cpu_flags(), reason="no x86 /proc/cpuinfo")
def test_the_cpu_family_is_cpuinfo_s() -> None:
    family = native.cpu_family()
    assert family > 0 and f"cpu family\t: {family}\n" in Path("/proc/cpuinfo").read_text()


@pytest.mark.skipif(not cpu_flags(), reason="no x86 /proc/cpuinfo")
def test_the_cpu_vendor_is_cpuinfo_s() -> None:
    vendor = native.cpu_vendor()
    assert vendor and f"vendor_id\t: {vendor}\n" in Path("/proc/cpuinfo").read_text()


def test_an_unknown_kernel_isa_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ISA_ENV_VAR, "avx9000")
    with pytest.raises(native.KernelBuildError, match="KVSERVE_CPU_ISA='avx9000'"):
        native.library_path(prepacked.SMALL_GEMM_SOURCE)


def test_small_gemm_refuses_what_does_not_fit(small: SmallGemm) -> None:
    panels = small.pack(torch.randn(40, 16))
    with pytest.raises(ValueError, match="does not fit panels"):
        small(torch.randn(2, 17), panels, None, 40)
    with pytest.raises(ValueError, match="does not fit panels"):
        small(torch.randn(2, 16, dtype=torch.float64), panels, None, 40)


def test_the_engine_keeps_panels_only_where_the_kernel_is_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SmallGemm, "__init__", lambda self: setattr(self, "tuned", False))
    prepacked.small_gemm.cache_clear()
    try:
        assert prepacked.small_gemm() is None
    finally:
        prepacked.small_gemm.cache_clear()


def test_only_fp32_on_cpu_is_prepacked() -> None:
    assert not can_prepack(torch.device("cpu"), torch.bfloat16)
    assert not can_prepack(torch.device("cuda"), torch.float32)


@pytest.mark.parametrize("with_small_gemm", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied and a tied LM head
def test_a_prepacked_model_computes_what_it_did(arch: str, with_small_gemm: bool, tiny_checkpoints: dict[str, Path],
                                                families: dict[str, Family], small: SmallGemm) -> None:
    family = families[arch]
    model = load_ours(tiny_checkpoints[arch], family.ours.backend)
    num_linears = sum(isinstance(m, Linear) for m in model.modules())
    method = CpuPrepackedLinearMethod(small if with_small_gemm else None)
    packed = build_model(model.config, family.ours.backend, torch.float32, "cpu", method)
    packed.load_weights(load_file(tiny_checkpoints[arch] / "model.safetensors").items())
    process_weights_after_loading(packed)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model.compute_logits(hidden)
        after = packed.compute_logits(hidden)
    assert sum(isinstance(m, Linear) and m.method is method for m in packed.modules()) == num_linears
    assert not any(isinstance(m, Linear) and "weight" in m._parameters for m in packed.modules())  # not kept
    assert torch.equal(packed.embed_tokens.weight, model.embed_tokens.weight)  # a tied head is packed into a copy
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
