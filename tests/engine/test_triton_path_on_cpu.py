"""The CUDA path's Triton pieces inside the whole engine, on CPU through Triton's interpreter: the attention
kernels (the K/V store, decodes, varlen prefill chunks), the fused elementwise ops and the skinny GEMMs of decode
steps give transformers' greedy tokens under chunked prefill and a prefix hit, and free every block; the
weight-only linears give the CPU block kernel's. ``-m gpu`` runs the same path compiled."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA

from kvserve import LLM  # noqa: E402
from kvserve.config import ATTENTION_BACKEND_ENV_VAR  # noqa: E402
from kvserve.attention import triton_paged  # noqa: E402
from kvserve.attention.triton_paged import TritonPagedBackend, is_interpreted  # noqa: E402
from kvserve.model import registry  # noqa: E402
from kvserve.model.layers.triton_fused_ops import TritonFusedOps  # noqa: E402
from kvserve.model.layers import triton_skinny  # noqa: E402
from kvserve.model.layers.activation import KERNEL_ACTIVATIONS  # noqa: E402
from kvserve.model.layers.triton_skinny import TritonSkinnyLinearMethod  # noqa: E402
from kvserve.model.layers.triton_tiles import NO_ACTIVATION  # noqa: E402
from kvserve.model.layers.triton_weight_only import TritonWeightOnlyLinearMethod  # noqa: E402
from tests.conftest import assert_all_blocks_free, greedy_token_ids, hf_greedy  # noqa: E402

pytestmark = pytest.mark.skipif(not is_interpreted(), reason="the interpreter on CPU; -m gpu runs it compiled")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding windows, q/k norms, sandwich norms
def test_triton_attention_fused_ops_and_skinny_gemms_in_the_engine_give_transformers_tokens(
    tiny_checkpoints, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The linear layers as on CUDA too: decode steps through the skinny GEMM (the MLP's activation in its
    loads), prefill chunks through torch's."""
    monkeypatch.setenv(ATTENTION_BACKEND_ENV_VAR, "triton")
    monkeypatch.setattr(registry, "select_fused_ops", lambda device, dtype: TritonFusedOps())
    monkeypatch.setattr(registry, "can_prepack", lambda device, dtype: False)
    monkeypatch.setattr(registry, "_plain_method", lambda device: TritonSkinnyLinearMethod())
    activations = []
    skinny_gemm = triton_skinny.skinny_gemm
    monkeypatch.setattr(triton_skinny, "skinny_gemm",
                        lambda x, weight, bias, activation=NO_ACTIVATION: activations.append(activation)
                        or skinny_gemm(x, weight, bias, activation))
    path = tiny_checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(1)
    shared = [rng.randrange(3, hf.config.vocab_size) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (3, 11)]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    assert isinstance(llm.engine.core.runner.backend, TritonPagedBackend)
    got = [greedy_token_ids(llm, [prompt], 6)[0][0] for prompt in prompts]  # the second hits the first's prefix
    assert got == [hf_greedy(hf, prompt, 6) for prompt in prompts]
    assert llm.stats()["prefix_cache_hits"] > 0
    assert NO_ACTIVATION in activations and set(activations) - {NO_ACTIVATION}  # down projections: gated
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: its windowed layers' decodes attend alone
def test_the_samples_of_one_prompt_attend_its_keys_once_and_give_transformers_tokens(
    tiny_checkpoints, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 greedy samples of a 70-token prompt share its blocks: their decodes go through cascade attention (the
    shared keys once per tile of decodes) and each gives transformers' tokens."""
    monkeypatch.setenv(ATTENTION_BACKEND_ENV_VAR, "triton")
    monkeypatch.setattr(registry, "select_fused_ops", lambda device, dtype: TritonFusedOps())
    cascades = []
    attend_shared_prefix = triton_paged._attend_shared_prefix
    monkeypatch.setattr(triton_paged, "_attend_shared_prefix",
                        lambda *args: cascades.append(args[-1]) or attend_shared_prefix(*args))
    path = tiny_checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(70)]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=32)
    samples = greedy_token_ids(llm, [prompt], 4, n=16)[0]
    assert samples == [hf_greedy(hf, prompt, 4)] * 16
    assert cascades  # some decode steps shared the prompt's keys
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_weight_only_linears_of_the_cuda_path_give_the_cpu_block_kernels_tokens(
    tiny_checkpoints, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--quantization int8|int4`` as on CUDA (``TritonWeightOnlyLinearMethod``, with the Triton attention and
    fused ops) against the CPU's exact block kernel on the same codes: the same greedy tokens, through chunked
    prefill and a prefix hit; decode steps through the skinny kernel on the codes."""
    path = str(tiny_checkpoints["llama"])
    options = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, quantization=scheme,
                   quantize_activations=False)
    rng = random.Random(2)
    shared = [rng.randrange(3, 200) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, 200) for _ in range(n)] for n in (3, 11)]
    expected = [greedy_token_ids(LLM(path, **options), [prompt], 6)[0][0] for prompt in prompts]
    select = registry.select_linear_method

    def select_as_on_cuda(device: torch.device, dtype: torch.dtype, weights: str, *args, **kwargs):
        return TritonWeightOnlyLinearMethod(weights) if weights == scheme else select(device, dtype, weights, *args,
                                                                                      **kwargs)

    monkeypatch.setattr(registry, "select_linear_method", select_as_on_cuda)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV_VAR, "triton")
    monkeypatch.setattr(registry, "select_fused_ops", lambda device, dtype: TritonFusedOps())
    llm = LLM(path, **options)
    assert llm.engine.core.runner.model.lm_head.packed_parts is not None  # the untied head is quantized too
    assert [greedy_token_ids(llm, [prompt], 6)[0][0] for prompt in prompts] == expected
    assert llm.stats()["prefix_cache_hits"] > 0 and llm.stats()["weights_format"] == f"{scheme} weight-only"
    # decode steps took the skinny kernel on the codes (always, untimed, under the interpreter), down gated
    method = llm.engine.core.runner.model.layers[0].mlp.down_proj.method
    assert {key[2] for key, took in method.skinny.made.items() if took} == {NO_ACTIVATION, KERNEL_ACTIVATIONS["silu"]}
    assert_all_blocks_free(llm)
