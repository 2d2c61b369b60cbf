"""GGUF blocks on CUDA: the Triton kernel against gguf's dequantize-then-matmul twin (through Triton's interpreter
without a GPU), inside the linear method that keeps a packed layer's projections, and (on a GPU) an engine on a
quantized GGUF against the same file dequantized."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.layers import ggml  # noqa: E402
from kvserve.model.layers.ggml import GGMLLinearMethod, GGMLTensor  # noqa: E402
from kvserve.model.layers.linear import PackedLinear, UnquantizedLinearMethod  # noqa: E402
from kvserve.model.layers.triton_ggml import TRITON_TYPES, TritonGGMLGemm  # noqa: E402
from tests.model.test_ggml import quantized_gguf  # noqa: F401, E402 (a fixture)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def blocks_of(weight: torch.Tensor, qtype: Q) -> GGMLTensor:
    return GGMLTensor.from_numpy(gguf.quants.quantize(weight.numpy(), qtype), qtype)


@pytest.mark.parametrize("qtype", sorted(TRITON_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 17, 70])
def test_kernel_equals_dequantize_then_matmul(qtype: Q, rows: int) -> None:
    """70 output rows: a partial tile of 64 columns; 17 and 70 rows: partial tiles of 16 and 64 rows."""
    gen = torch.Generator().manual_seed(rows)
    weight = blocks_of(torch.randn(70, 96, generator=gen), qtype)
    x, bias = torch.randn(rows, 96 + 8, generator=gen)[:, 4:100], torch.randn(70, generator=gen)
    expected = ggml.reference_linear(x, weight, bias)
    kernel = TritonGGMLGemm()
    on_device = kernel.place(weight, torch.device(DEVICE))
    y = kernel(x.to(DEVICE), on_device, bias.to(DEVICE))
    torch.testing.assert_close(y.cpu(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="bf16 dots need a GPU (the interpreter multiplies in fp32)")
def test_kernel_in_bf16_stays_within_bf16s_rounding() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = blocks_of(torch.randn(256, 512, generator=gen), Q.Q4_1)
    x = torch.randn(9, 512, generator=gen)
    expected = ggml.reference_linear(x.bfloat16().float(), weight, None)
    kernel = TritonGGMLGemm()
    y = kernel(x.to("cuda", torch.bfloat16), kernel.place(weight, torch.device("cuda")), None).float().cpu()
    assert ((y - expected).abs() <= 2e-2 * (x.abs() @ weight.dequantize().abs().T) / 64 + 1e-2).all()


def test_a_packed_layer_multiplies_each_projection_into_its_columns() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k = blocks_of(torch.randn(32, 64, generator=gen), Q.Q8_0), blocks_of(torch.randn(16, 64, generator=gen), Q.Q8_0)
    layer = PackedLinear(64, {"q_proj": 32, "k_proj": 16}, bias=False)
    layer.bind(GGMLLinearMethod(TritonGGMLGemm(), UnquantizedLinearMethod(), keep_dense=False), torch.float32)
    layer.to_empty(device=DEVICE)
    layer.load_weight("weight", q, shard="q_proj")
    layer.load_weight("weight", k, shard="k_proj")
    layer.process_weights_after_loading()
    assert [part.blocks.device.type for part in layer.ggml_parts] == [DEVICE, DEVICE]
    x = torch.randn(5, 64, generator=gen)
    expected = x @ torch.cat([q.dequantize(), k.dequantize()]).T
    torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), expected, rtol=1e-5, atol=1e-4)


def test_the_kernel_refuses_a_type_it_does_not_read() -> None:
    weight = blocks_of(torch.randn(8, 64), Q.Q8_0)
    with pytest.raises(ValueError, match="does not fit a Q2_K weight"):
        TritonGGMLGemm()(torch.randn(2, 64), GGMLTensor(weight.blocks, Q.Q2_K, weight.shape), None)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="needs CUDA")
def test_an_engine_on_cuda_keeps_the_blocks_and_agrees_with_the_dequantized_file(quantized_gguf: Path) -> None:  # noqa: F811
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 30, 31, 40]}, {"prompt_token_ids": [7] * 3}]
    kept = LLM(str(quantized_gguf), num_kv_blocks=64, device="cuda", dtype="float32", quantization="gguf")
    dense = LLM(str(quantized_gguf), num_kv_blocks=64, device="cuda", dtype="float32")
    assert kept.stats()["weights_format"] == "gguf Q4_1" and dense.stats()["weights_format"] == "float32"
    assert ([o.outputs[0].token_ids for o in kept.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in dense.generate(prompts, params)])
