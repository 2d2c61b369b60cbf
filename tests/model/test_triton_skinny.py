"""Triton's skinny GEMM for decode steps on CUDA: the kernel against ``F.linear`` (through Triton's interpreter
without a GPU) on dense weights and on weight-only codes, with the gated MLP's activation folded into its loads
against ``act_and_mul`` then ``F.linear``, the linear method's measured choice between it and torch's GEMM, and a
gated MLP through it; ``-m gpu`` at Llama-3-8B's projections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA

from kvserve.model.layers import triton_skinny  # noqa: E402
from kvserve.model.layers.activation import ACTIVATIONS, KERNEL_ACTIVATIONS, GatedMLP  # noqa: E402
from kvserve.model.layers.fused_ops import TorchFusedOps  # noqa: E402
from kvserve.model.layers.linear import linear_from_tensors  # noqa: E402
from kvserve.model.layers.triton_skinny import SKINNY_ROWS, TritonSkinnyLinearMethod, skinny_gemm  # noqa: E402
from kvserve.model.layers.triton_tiles import NO_ACTIVATION, MeasuredChoices  # noqa: E402
from kvserve.model.layers.weight_quant import PackedWeight, quantize_rows  # noqa: E402
from tests.model.conftest import UNIT_ROUNDOFF, assert_within_half_precision_rounding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GATED = ["silu", "gelu_pytorch_tanh"]


def gated_product(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [90, 160])  # 90: a last tile of K that is partial
def test_kernel_in_fp32_equals_f_linear_within_rounding(rows: int, k: int) -> None:
    """70 output columns: a partial tile of N; x's rows strided; a bias. The kernel and F.linear differ only in
    the order of the sums."""
    gen = torch.Generator().manual_seed(rows * k)
    weight, bias = torch.randn(70, k, generator=gen), torch.randn(70, generator=gen)
    x = torch.randn(rows, k + 8, generator=gen)[:, 4 : 4 + k]
    y = skinny_gemm(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE)).cpu()
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("rows", [1, 3])
def test_gated_kernel_in_fp32_equals_the_activation_then_f_linear(activation: str, rows: int) -> None:
    """x is the MLP's packed [gate | up]: the kernel multiplies act(gate) * up as it loads it."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(40, 96, generator=gen)
    gate_up = torch.randn(rows, 192, generator=gen)
    y = skinny_gemm(gate_up.to(DEVICE), weight.to(DEVICE), None, KERNEL_ACTIVATIONS[activation]).cpu()
    expected = F.linear(gated_product(gate_up, activation), weight)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 4])
def test_kernel_in_half_precision_stays_within_its_rounding(dtype: torch.dtype, rows: int) -> None:
    """Weights and x in the dtype (exact in fp32), products summed in fp32, the output rounded once."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 80, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    y = skinny_gemm(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE)).cpu()
    assert_within_half_precision_rounding(y, x, weight.float(), bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gated_kernel_in_half_precision_rounds_the_product_as_act_and_mul_stores_it(dtype: torch.dtype) -> None:
    """The product is rounded to the dtype before it is multiplied, as the unfused path stores it: within the
    rounding of that product (at most one unit roundoff of it) and of the output."""
    gen = torch.Generator().manual_seed(5)
    weight, gate_up = torch.randn(48, 64, generator=gen).to(dtype), torch.randn(2, 128, generator=gen).to(dtype)
    y = skinny_gemm(gate_up.to(DEVICE), weight.to(DEVICE), None, KERNEL_ACTIVATIONS["silu"]).cpu().float()
    product = gated_product(gate_up.float(), "silu")
    expected = product @ weight.float().T
    u = UNIT_ROUNDOFF[dtype]
    bound = 2 * u * (product.abs() @ weight.float().abs().T) + u * expected.abs() + 1e-6
    assert ((y - expected).abs() <= bound).all()


def test_shapes_it_does_not_take_are_refused_by_name() -> None:
    weight = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 4 rows of 16"):
        skinny_gemm(torch.randn(SKINNY_ROWS + 1, 16, device=DEVICE), weight, None)
    with pytest.raises(ValueError, match="rows of 32"):  # gated: [gate | up] is twice the weight's K
        skinny_gemm(torch.randn(1, 16, device=DEVICE), weight, None, KERNEL_ACTIVATIONS["silu"])
    assert skinny_gemm(torch.randn(0, 16, device=DEVICE), weight, None).shape == (0, 8)


def timed(times: dict[str, float]):
    """A timer that answers each call by whether it is the method's call of the skinny kernel."""
    def timer(call) -> float:
        return times["skinny" if call.__name__ == "skinny" else "torch"]
    return timer


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    kernel = triton_skinny.skinny_gemm
    monkeypatch.setattr(triton_skinny, "skinny_gemm", lambda *args: calls.append("skinny") or kernel(*args))
    return calls


@pytest.mark.parametrize("faster", ["skinny", "torch"])
def test_the_method_keeps_what_measured_faster_per_rows_class(faster: str, counted: list[str]) -> None:
    times = {"skinny": 1.0, "torch": 2.0} if faster == "skinny" else {"skinny": 2.0, "torch": 1.0}
    method = TritonSkinnyLinearMethod(timer=timed(times))
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 32, generator=gen), torch.randn(24, generator=gen)
    layer = linear_from_tensors(weight.to(DEVICE), bias.to(DEVICE), method)
    for rows in (1, 3, 4, 5, 9):
        x = torch.randn(2, rows, 32, generator=gen).to(DEVICE)[0]
        layer(x)  # the first step of its class: timed where the kernel may take it
        counted.clear()
        y = layer(x).cpu()
        torch.testing.assert_close(y, F.linear(x.cpu(), weight, bias), rtol=1e-5, atol=1e-4)
        assert counted == (["skinny"] if faster == "skinny" and rows <= SKINNY_ROWS else [])
    assert sorted(key[-1] for key in method.skinny.made) == [1, 4]  # 3 and 4 rows: one class; 5 and 9 rows: never timed


def gated_mlp(activation: str, method: TritonSkinnyLinearMethod) -> tuple[GatedMLP, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    mlp = GatedMLP(32, 48, activation, bias=False)
    gate_up, down = torch.randn(96, 32, generator=gen) / 4, torch.randn(32, 48, generator=gen) / 4
    for layer, weight in ((mlp.gate_up_proj, gate_up), (mlp.down_proj, down)):
        layer.bind(method, torch.float32)
        layer.load_weight("weight", weight.to(DEVICE))
        layer.process_weights_after_loading()
    return mlp.to(DEVICE), gate_up, down


@pytest.mark.parametrize("activation", [*GATED, "gelu"])  # exact GELU: no kernel computes it
def test_a_gated_mlp_folds_its_activation_into_the_down_projection_where_a_kernel_computes_it(
    activation: str, counted: list[str]
) -> None:
    mlp, gate_up, down = gated_mlp(activation, TritonSkinnyLinearMethod(timed({"skinny": 1.0, "torch": 2.0})))
    mlp.ops = TorchFusedOps()
    products = []
    act_and_mul = mlp.ops.act_and_mul
    mlp.ops.act_and_mul = lambda module, x: products.append(x.shape[0]) or act_and_mul(module, x)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        mlp(x.to(DEVICE))  # the first step of its class: timed
        counted.clear(), products.clear()
        y = mlp(x.to(DEVICE)).cpu()
    expected = F.linear(gated_product(F.linear(x, gate_up), activation), down)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert counted == ["skinny", "skinny"]  # gate_up, then down: with its activation, or after act_and_mul
    assert products == ([] if activation in KERNEL_ACTIVATIONS else [2])


def test_the_gated_choice_times_the_fold_against_torch_with_the_activations_launch(counted: list[str]) -> None:
    """Torch's side of a gated choice runs ``act_and_mul`` and then the layer's own plain choice; torch timed
    faster, no step takes the kernel after the timing."""
    method = TritonSkinnyLinearMethod(timer=timed({"skinny": 2.0, "torch": 1.0}))
    mlp, gate_up, down = gated_mlp("silu", method)
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        mlp(x.to(DEVICE))
        counted.clear()
        y = mlp(x.to(DEVICE)).cpu()
    torch.testing.assert_close(y, F.linear(gated_product(F.linear(x, gate_up), "silu"), down), rtol=1e-5, atol=1e-5)
    assert not counted
    assert method.skinny.made == {(96, 32, NO_ACTIVATION, torch.float32, 1): False,
                              (32, 48, KERNEL_ACTIVATIONS["silu"], torch.float32, 1): False,
                              (32, 48, NO_ACTIVATION, torch.float32, 1): False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Llama-3-8B's projections at their size need a GPU")
@pytest.mark.parametrize("rows", [1, 4])
def test_llama3_8b_projections_on_cuda_stay_within_bf16_rounding(rows: int) -> None:
    """The o and down projections' shapes (down gated), tuned and compiled, against the fp32 product of the same
    bf16 values."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for n, k, activation in ((4096, 4096, NO_ACTIVATION), (4096, 14336, KERNEL_ACTIVATIONS["silu"])):
        weight = (torch.randn(n, k, generator=gen, device="cuda") / 64).to(torch.bfloat16)
        width = k if activation == NO_ACTIVATION else 2 * k
        x = torch.randn(rows, width, generator=gen, device="cuda").to(torch.bfloat16)
        y = skinny_gemm(x, weight, None, activation)
        inputs = x if activation == NO_ACTIVATION else gated_product(x.float(), "silu").to(torch.bfloat16)
        assert_within_half_precision_rounding(y, inputs, weight.float(), torch.zeros(n, device="cuda"))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("k", [128, 160])  # 160: INT4's last group of 32
def test_kernel_on_weight_only_codes_equals_the_dequantized_product(scheme: str, rows: int, k: int) -> None:
    """Each value built in fp32 from its code, scale and offset (one rounding, as ``dequantize``), then the fp32
    product: within fp32 rounding of x @ the dequantized weight; gated too."""
    gen = torch.Generator().manual_seed(rows * k)
    weight = PackedWeight.of(quantize_rows(torch.randn(37, k, generator=gen), scheme))
    values, bias = weight.dequantize(), torch.randn(37, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    codes = PackedWeight(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in weight))
    y = skinny_gemm(x.to(DEVICE), codes, bias.to(DEVICE)).cpu()
    expected = F.linear(x, values, bias)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    gate_up = torch.randn(rows, 2 * k, generator=gen)
    y = skinny_gemm(gate_up.to(DEVICE), codes, None, KERNEL_ACTIVATIONS["silu"]).cpu()
    expected = F.linear(gated_product(gate_up, "silu"), values)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_codes_in_groups_the_tiles_cannot_follow_are_refused() -> None:
    weight = PackedWeight.of(quantize_rows(torch.randn(8, 256), "int4"))
    odd = weight._replace(group_size=96)
    with pytest.raises(ValueError, match="in groups of 96"):
        skinny_gemm(torch.randn(1, 256), odd, None)


def test_a_candidate_that_fails_to_run_is_not_chosen_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """An optional kernel the compiler or device refuses leaves the step to the other way, with a warning."""
    choices = MeasuredChoices("skinny", default=True, timer=lambda call: 1.0)

    def refused() -> None:
        raise triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")

    with caplog.at_level("WARNING"):
        assert not choices(("o", 1), refused, lambda: None, torch.device("cpu"))
    assert choices.made == {("o", 1): False} and "skinny for ('o', 1) failed to run or time" in caplog.text
