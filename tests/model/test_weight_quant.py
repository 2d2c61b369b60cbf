"""Weight-only INT8 / INT4 at load: the blocks hold what the schemes say (per-channel scales, groups of 128),
the block kernel multiplies by them as their dequantization does, and whole models stay within stated bounds
of fp32 on every family's tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.layers.ggml import ggml_gemm, reference_linear
from kvserve.model.layers.ggml_qdot import reference_qdot_linear
from kvserve.model.layers.linear import Linear
from kvserve.model.layers.weight_quant import INT4_GROUP_SIZE, WeightOnlyLinearMethod, quantize_weight
from kvserve.model.registry import select_linear_method

# Largest |error| of a dequantized weight relative to its row's largest |value| (INT8: half a step of 1/127;
# INT4: half a step of a group's range / 15, a range at most twice the row's largest magnitude).
WEIGHT_BOUND = {"int8": 0.5 / 127 + 1e-3, "int4": 2 * 0.5 / 15 + 1e-2}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(7, 64), (33, 576), (5, 160)])
def test_dequantized_blocks_are_within_half_a_step(scheme: str, shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[0] = 0.0  # a row of zeros has a zero scale
    blocks = quantize_weight(weight, scheme)
    restored = blocks.dequantize()
    row_max = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    assert ((restored - weight).abs() / row_max).max() <= WEIGHT_BOUND[scheme]
    assert torch.equal(restored[0], weight[0])
    assert torch.equal(quantize_weight(weight, scheme).blocks, blocks.blocks)  # deterministic


def test_int4_groups_share_one_scale_and_int8_rows_one_scale() -> None:
    weight = torch.randn(3, 320, generator=torch.Generator().manual_seed(1))  # groups of 128, 128 and 64
    q4 = quantize_weight(weight, "int4").blocks.view(3, 10, 20)
    scales = q4[..., :2].contiguous().view(torch.float16).squeeze(-1)
    assert INT4_GROUP_SIZE == 128
    assert (scales[:, :4] == scales[:, :1]).all() and (scales[:, 4:8] == scales[:, 4:5]).all()
    assert (scales[:, 8:] == scales[:, 8:9]).all() and not (scales[:, 0] == scales[:, 8]).all()
    q8 = quantize_weight(weight, "int8").blocks.view(3, 10, 34)
    row_scales = q8[..., :2].contiguous().view(torch.float16).squeeze(-1)
    assert (row_scales == row_scales[:, :1]).all()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_kernel_multiplies_by_the_blocks_as_their_dequantization_does(scheme: str) -> None:
    kernel = ggml_gemm()
    assert kernel is not None
    gen = torch.Generator().manual_seed(2)
    weight, x, bias = torch.randn(45, 192, generator=gen), torch.randn(3, 192, generator=gen), torch.randn(45)
    blocks = quantize_weight(weight, scheme)
    torch.testing.assert_close(kernel(x, blocks, bias), reference_linear(x, blocks, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_with_int8_activations_every_step_runs_on_the_blocks(scheme: str) -> None:
    """``--quantize-activations``: no dense copy of the quantized weight; a step of many tokens goes through the
    int8 strips kernel, within fp32 rounding of the int8 path's twin."""
    method = select_linear_method(torch.device("cpu"), torch.float32, scheme, quantize_activations=True)
    assert isinstance(method, WeightOnlyLinearMethod) and not method.keep_dense
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(45, 256, generator=gen)
    layer = Linear(256, 45, bias=False)
    layer.bind(method, torch.float32)
    layer.load_weight("weight", weight)
    layer.process_weights_after_loading()
    assert layer.weight.numel() == 0
    x = torch.randn(21, 256, generator=gen)
    torch.testing.assert_close(layer(x), reference_qdot_linear(x, quantize_weight(weight, scheme), None),
                               rtol=1e-5, atol=1e-4)


# Max |difference| of the chosen tokens' logprobs to the fp32 model's, teacher-forced, on the tiny checkpoints:
# random weights of std 0.25 make activations and so quantization errors far larger than a trained model's
# (measured: int8 at most 0.28, int4 at most 5.0, over every family); the default model's much tighter figures
# are asserted in test_real_models.py.
LOGIT_BOUND = {"int8": 0.5, "int4": 8.0}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_every_family_stays_within_the_stated_bound(tiny_checkpoints, scheme: str) -> None:
    prompts = [{"prompt_token_ids": [3, 17, 42, 99, 7, 250, 31]}, {"prompt_token_ids": [5, 6, 7]}]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5)
    for family, path in tiny_checkpoints.items():
        dense = LLM(str(path), num_kv_blocks=64)
        quantized = LLM(str(path), num_kv_blocks=64, quantization=scheme)
        assert quantized.stats()["weights_format"] == f"{scheme} weight-only"
        # teacher-force the dense model's tokens so every position compares the same context
        expected = dense.generate(prompts, params)
        forced = [{"prompt_token_ids": p["prompt_token_ids"] + list(o.outputs[0].token_ids)}
                  for p, o in zip(prompts, expected)]
        scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        for a, b in zip(dense.generate(forced, scored), quantized.generate(forced, scored)):
            diffs = [abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob)
                     for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
            assert max(diffs) < LOGIT_BOUND[scheme], (family, max(diffs))


def test_weight_only_quantization_refuses_what_it_cannot_run(tiny_checkpoints) -> None:
    with pytest.raises(ValueError, match="quantization=.int4. runs on CUDA, or on CPU with fp32"):
        LLM(str(tiny_checkpoints["llama"]), quantization="int4", dtype="bfloat16")
