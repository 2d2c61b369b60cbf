"""Weight-only INT8 / INT4 on CUDA: the GPU layout holds the CPU's quantization (the same values on both devices),
the Triton kernel against its dequantize-then-matmul twin (through Triton's interpreter without a GPU), the linear
method inside a packed layer and a whole tiny model against the CPU's block kernel on the same quantization, and
(on a GPU) engines on every family against the CPU engine."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.attention.torch_ref import TorchRefBackend  # noqa: E402
from kvserve.model.layers.linear import PackedLinear  # noqa: E402
from kvserve.model.layers.triton_weight_only import (  # noqa: E402
    TritonWeightOnlyLinearMethod, dequantize, reference_linear, weight_only_gemm,
)
from kvserve.model.layers.weight_quant import PackedWeight, quantize_rows, quantize_weight  # noqa: E402
from kvserve.model.loader import load_checkpoint  # noqa: E402
from kvserve.model.registry import (  # noqa: E402
    _load_offloaded, build_model, process_weights_after_loading, select_linear_method,
)
from kvserve.model.weight_format import weight_format  # noqa: E402
from kvserve.model.sources import resolve_model  # noqa: E402
from tests.model.conftest import (  # noqa: E402
    HALF_DTYPES, TRITON_INTERPRETED, PagedRunner, assert_within_half_precision_rounding,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCHEMES = ["int8", "int4"]


def packed(n: int, k: int, scheme: str, seed: int) -> tuple[PackedWeight, torch.Tensor]:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    weight[1] = 0.0  # a zero scale
    quantized = quantize_rows(weight.to(DEVICE), scheme)
    return PackedWeight.of(quantized), quantized.dequantize().cpu()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("k", [64, 160, 576])
def test_the_gpu_layout_holds_the_values_of_the_cpus_blocks(scheme: str, k: int) -> None:
    """k = 160 and 576: INT4's last group shorter than 128. Quantized on the layer's device, packed two codes a
    byte for INT4: the same fp32 values as the CPU's ggml blocks of the same weight, bit for bit."""
    weight, values = packed(37, k, scheme, seed=k)
    assert weight.shape == (37, k) and weight.int4 == (scheme == "int4")
    assert weight.codes.shape == (37, k // 2 if scheme == "int4" else k)
    assert weight.scale.shape == (37, -(-k // 128) if scheme == "int4" else 1)
    original = torch.randn(37, k, generator=torch.Generator().manual_seed(k))
    original[1] = 0.0
    assert torch.equal(values, quantize_weight(original, scheme).dequantize())
    assert torch.equal(weight.dequantize().cpu(), values)


def run(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return weight_only_gemm(x.to(DEVICE), weight, None if bias is None else bias.to(DEVICE, x.dtype)).cpu()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("k", [160, 576])
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_kernel_in_fp32_equals_dequantize_then_matmul(scheme: str, k: int, rows: int) -> None:
    """70 output columns: partial tiles; x's rows strided; within fp32 rounding of the twin (the two differ
    only in the order of the sums)."""
    gen = torch.Generator().manual_seed(rows * k)
    weight, values = packed(70, k, scheme, seed=rows + k)
    x, bias = torch.randn(rows, k + 8, generator=gen)[:, 4 : 4 + k], torch.randn(70, generator=gen)
    y = run(x, weight, bias)
    expected = x @ values.T + bias
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    torch.testing.assert_close(y, reference_linear(x.to(DEVICE), weight, bias.to(DEVICE)).cpu(), rtol=1e-5,
                               atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_kernel_in_half_precision_stays_within_its_rounding(scheme: str, rows: int, dtype: torch.dtype) -> None:
    """The tensor-core path, within its rounding of the dequantized values
    (``assert_within_half_precision_rounding``)."""
    gen = torch.Generator().manual_seed(rows)
    weight, values = packed(70, 576, scheme, seed=rows)
    x, bias = torch.randn(rows, 576, generator=gen).to(dtype), torch.randn(70, generator=gen).to(dtype)
    assert_within_half_precision_rounding(run(x, weight, bias), x, values, bias)


def test_the_kernel_writes_into_a_column_range_and_refuses_a_misfit() -> None:
    weight, values = packed(24, 128, "int4", seed=3)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = torch.full((2, 40), float("nan"), device=DEVICE)
    weight_only_gemm(x, weight, None, out[:, 8:32])
    assert out[:, :8].isnan().all() and out[:, 32:].isnan().all()
    torch.testing.assert_close(out[:, 8:32].cpu(), x.cpu() @ values.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"x \(2, 64\) does not fit a weight of shape \(24, 128\)"):
        weight_only_gemm(x[:, :64], weight, None)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_packed_layer_quantizes_each_projection_on_its_device_and_joins_them(scheme: str) -> None:
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(32, 256, generator=gen), torch.randn(16, 256, generator=gen)
    layer = PackedLinear(256, {"q_proj": 32, "k_proj": 16}, bias=True)
    layer.bind(TritonWeightOnlyLinearMethod(scheme), torch.float32)
    layer.to_empty(device=DEVICE)
    layer.load_weight("weight", q, shard="q_proj")
    layer.load_weight("weight", k, shard="k_proj")
    bias = torch.randn(48, generator=gen)
    layer.load_weight("bias", bias)
    layer.process_weights_after_loading()
    assert [part.shape for part in layer.packed_parts] == [(48, 256)]
    assert layer.packed_parts[0].codes.device.type == DEVICE
    x = torch.randn(5, 256, generator=gen)
    dense = torch.cat([quantize_rows(q, scheme).dequantize(), quantize_rows(k, scheme).dequantize()])
    torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), x @ dense.T + bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_model_on_the_triton_method_gives_the_cpu_block_kernels_logits(tiny_checkpoints, scheme: str) -> None:
    """Against the CPU's exact block kernel (fp32 activations), for a tied-head family (Qwen2's tiny checkpoint
    ties; its head stays the embeddings') and Llama (untied, its head quantized too): the same quantization on
    either device, so the same logits up to fp32 rounding; a prefill of 5 tokens and a decode."""
    backend = TorchRefBackend()
    for family in ("llama", "qwen2"):
        checkpoint = load_checkpoint(resolve_model(str(tiny_checkpoints[family])), torch.float32)
        models = []
        exact_cpu = select_linear_method(torch.device("cpu"), torch.float32, scheme, quantize_activations=False)
        for device, method in ((DEVICE, TritonWeightOnlyLinearMethod(scheme)), ("cpu", exact_cpu)):
            model = build_model(checkpoint.hf_config, backend, torch.float32, device, method)
            model.load_weights(checkpoint.weights())
            process_weights_after_loading(model)
            models.append(model.eval())
        tied = checkpoint.hf_config.tie_word_embeddings
        assert (models[0].lm_head.packed_parts is None) == tied, family
        runners = [PagedRunner(model, backend, 1, 16) for model in models]
        prompt = [5, 9, 30, 31, 40, 77]
        for chunk in (prompt[:-1], prompt[-1:]):
            logits, expected = (runner.step({0: chunk})[0].cpu() for runner in runners)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_cuda_takes_weight_only_schemes_in_every_dtype(tiny_checkpoints) -> None:
    checkpoint = load_checkpoint(resolve_model(str(tiny_checkpoints["llama"])), torch.bfloat16)
    cuda = torch.device("cuda")
    for scheme in SCHEMES:
        assert weight_format(scheme, checkpoint, cuda, torch.bfloat16, dtype_forced=True) == scheme
        assert isinstance(select_linear_method(cuda, torch.bfloat16, scheme), TritonWeightOnlyLinearMethod)
    with pytest.raises(ValueError, match="cpu_offload_gb streams dense weights; the 'int4' layout is not streamed"):
        _load_offloaded(checkpoint, TorchRefBackend(), torch.bfloat16, cuda, "int4", False, None, 2**30)


@pytest.mark.gpu
@pytest.mark.skipif(TRITON_INTERPRETED, reason="needs CUDA")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_engines_on_cuda_give_the_cpu_engines_tokens(tiny_checkpoints, scheme: str) -> None:
    """fp32 activations on both devices over the same quantized values: the same greedy tokens, for every family;
    bf16 runs with fewer weight bytes than bf16's and frees every block."""
    prompts = [{"prompt_token_ids": [5, 9, 30, 31, 40]}, {"prompt_token_ids": [7] * 3}]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for family, path in tiny_checkpoints.items():
        on_cuda = LLM(str(path), num_kv_blocks=64, device="cuda", dtype="float32", quantization=scheme)
        on_cpu = LLM(str(path), num_kv_blocks=64, device="cpu", quantization=scheme, quantize_activations=False)
        assert on_cuda.stats()["weights_format"] == f"{scheme} weight-only"
        assert ([o.outputs[0].token_ids for o in on_cuda.generate(prompts, params)]
                == [o.outputs[0].token_ids for o in on_cpu.generate(prompts, params)]), family
    half = LLM(str(tiny_checkpoints["llama"]), num_kv_blocks=64, device="cuda", dtype="bfloat16", quantization=scheme)
    dense = LLM(str(tiny_checkpoints["llama"]), num_kv_blocks=64, device="cuda", dtype="bfloat16")
    outs = half.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs) and half.stats()["num_blocks_used"] == 0
    assert half.stats()["weights_bytes"] < dense.stats()["weights_bytes"]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dequantize_writes_the_values_the_kernel_builds(scheme: str, dtype: torch.dtype) -> None:
    weight, values = packed(40, 576, scheme, seed=9)
    out = torch.full((40, 576), float("nan"), dtype=dtype, device=DEVICE)
    assert dequantize(weight, out) is out
    assert torch.equal(out.cpu(), values.to(dtype))
    with pytest.raises(ValueError, match=r"dequantize: out \(576, 40\) is not rows of \[40, 576\]"):
        dequantize(weight, out.T)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_batched_step_takes_the_gemm_that_timed_faster_for_its_class(scheme: str) -> None:
    """A fake timer says the dequantized GEMM is faster for up to 64 rows and slower for 128: each class is
    timed once, both ways; decode-sized steps are never timed; every path gives the same product; one scratch
    matrix, of the largest layer's size, serves every layer."""
    timed: list[str] = []

    def timer(call) -> float:  # the dequantized GEMM, the skinny kernel or the packed kernel (a lambda)
        timed.append(call.__name__)
        return {"dequantized": 3.0 if rows > 64 else 1.0, "skinny": 1.0}.get(call.__name__, 2.0)

    method = TritonWeightOnlyLinearMethod(scheme, timer=timer)
    gen = torch.Generator().manual_seed(10)
    layers = []
    for n, k in ((48, 256), (96, 128)):
        layer = PackedLinear(k, {"gate_proj": n // 2, "up_proj": n // 2}, bias=False)
        layer.bind(method, torch.float32)
        layer.to_empty(device=DEVICE)
        for shard in ("gate_proj", "up_proj"):
            layer.load_weight("weight", torch.randn(n // 2, k, generator=gen), shard=shard)
        layer.process_weights_after_loading()
        layers.append(layer)
    assert method.largest == 96 * 128
    for rows, dequantized in ((1, False), (16, False), (17, True), (32, True), (128, False)):
        for layer in layers:
            x = torch.randn(rows, layer.in_features, generator=gen)
            expected = x @ layer.packed_parts[0].dequantize().cpu().T
            torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), expected, rtol=1e-5, atol=1e-4)
            key = (*layer.packed_parts[0].shape, scheme == "int4", torch.float32, triton.next_power_of_2(rows))
            assert method.dequantized_gemm.made.get(key, False) == dequantized, (rows, key)
    # two layers, two classes (17 and 32 share 32; then 128), both ways; one row: the skinny kernel, both ways
    assert timed.count("dequantized") == 2 * 2 and len(timed) == 2 * 2 * 2 + 2 * 2
    assert method._scratch is not None and method._scratch.numel() == 96 * 128
