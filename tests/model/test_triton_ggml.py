"""GGUF blocks on CUDA: the Triton kernel against gguf's dequantize-then-matmul twin (through Triton's interpreter
without a GPU) for every block type it reads, inside the linear method that keeps a packed layer's projections,
a tiny Q4_K_M-like model through it against the same file dequantized, and (on a GPU) an engine on a quantized
GGUF against the same file dequantized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.attention.torch_ref import TorchRefBackend  # noqa: E402
from kvserve.model.layers.ggml import GGMLLinearMethod, GGMLTensor  # noqa: E402
from kvserve.model.layers.linear import PackedLinear, UnquantizedLinearMethod  # noqa: E402
from kvserve.model.layers.triton_ggml import BLOCK_VALUES, TRITON_TYPES, TritonGGMLGemm  # noqa: E402
from kvserve.model.loader import load_checkpoint  # noqa: E402
from kvserve.model.registry import build_model, process_weights_after_loading  # noqa: E402
from kvserve.model.weight_format import kept_block_types  # noqa: E402
from tests.model.conftest import (  # noqa: E402
    HALF_DTYPES, TRITON_INTERPRETED, PagedRunner, assert_within_half_precision_rounding,
)
from tests.model.test_ggml import (  # noqa: E402
    K_TYPES, assert_close_to_reference, blocks_of, quantized_gguf, random_blocks,  # noqa: F401 (a fixture)
)
from tests.model.test_loader import byte_level_tokens, gguf_location, tiny_llama, write_gguf  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def weight_of(qtype: Q, n: int, k: int, gen: torch.Generator) -> GGMLTensor:
    """Valid blocks of ``qtype``: gguf's quantization of random weights, or random K-quant blocks (which gguf
    does not quantize)."""
    return random_blocks(n, k, qtype, gen) if qtype in K_TYPES else blocks_of(torch.randn(n, k, generator=gen), qtype)


def run_kernel(x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel = TritonGGMLGemm()
    bias = None if bias is None else bias.to(DEVICE, x.dtype)
    return kernel(x.to(DEVICE), kernel.place(weight, torch.device(DEVICE)), bias).cpu()


@pytest.mark.parametrize("qtype", sorted(TRITON_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("rows", [1, 3, 17, 70])
def test_kernel_in_fp32_equals_dequantize_then_matmul(qtype: Q, k: int, rows: int) -> None:
    """70 output columns: a partial tile of 64; 1 and 3 rows: a partial tile of 16, 17: of 64, 70: two tiles of
    64, the second partial; x's rows strided. Within fp32 rounding of the twin: the two differ only in the order
    of the sums."""
    gen = torch.Generator().manual_seed(rows * k)
    weight = weight_of(qtype, 70, k, gen)
    x, bias = torch.randn(rows, k + 8, generator=gen)[:, 4 : 4 + k], torch.randn(70, generator=gen)
    assert_close_to_reference(run_kernel(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("qtype", sorted(TRITON_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_kernel_in_half_precision_stays_within_its_rounding(qtype: Q, k: int, rows: int, dtype: torch.dtype) -> None:
    """The tensor-core path, within its rounding of gguf's values (``assert_within_half_precision_rounding``)."""
    gen = torch.Generator().manual_seed(rows * k + 1)
    weight = weight_of(qtype, 70, k, gen)
    x, bias = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(70, generator=gen).to(dtype)
    assert_within_half_precision_rounding(run_kernel(x, weight, bias), x, weight.dequantize(), bias)


@pytest.mark.parametrize("qtype", sorted(TRITON_TYPES), ids=lambda t: t.name)
def test_the_kernel_decodes_gguf_values(qtype: Q) -> None:
    """x = I gives W.T: through the interpreter gguf's values bit for bit (the same fp32 operations); on a GPU
    Triton may fuse a decode's multiply and add (Q4_1, Q5_1, Q4_K, Q5_K), one rounding fewer."""
    weight = weight_of(qtype, 40, 512, torch.Generator().manual_seed(5))
    y, dense = run_kernel(torch.eye(512), weight, None), weight.dequantize()
    if TRITON_INTERPRETED:
        assert torch.equal(y, dense.T)
    else:
        torch.testing.assert_close(y, dense.T, rtol=1e-6, atol=1e-6 * float(dense.abs().max()))


@pytest.mark.parametrize("qtype", sorted(TRITON_TYPES), ids=lambda t: t.name)
def test_dequantize_gives_ggufs_values(qtype: Q) -> None:
    """What ``GGMLLinearMethod`` lays out densely for a layer it does not keep (a packed layer of mixed types)."""
    weight = weight_of(qtype, 9, 512, torch.Generator().manual_seed(6))
    out = torch.full(weight.shape, float("nan"))
    assert TritonGGMLGemm().dequantize(weight, out) is out
    assert torch.equal(out, weight.dequantize())


def test_a_packed_layer_multiplies_each_projection_into_its_columns() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k = random_blocks(32, 256, Q.Q4_K, gen), random_blocks(16, 256, Q.Q4_K, gen)
    layer = PackedLinear(256, {"q_proj": 32, "k_proj": 16}, bias=False)
    layer.bind(GGMLLinearMethod(TritonGGMLGemm(), UnquantizedLinearMethod(), keep_dense=False), torch.float32)
    layer.to_empty(device=DEVICE)
    layer.load_weight("weight", q, shard="q_proj")
    layer.load_weight("weight", k, shard="k_proj")
    layer.process_weights_after_loading()
    assert [part.blocks.device.type for part in layer.ggml_parts] == [DEVICE, DEVICE]
    x = torch.randn(5, 256, generator=gen)
    expected = x @ torch.cat([q.dequantize(), k.dequantize()]).T
    torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), expected, rtol=1e-5, atol=1e-4)


def test_the_kernel_refuses_a_type_it_does_not_read() -> None:
    weight = blocks_of(torch.randn(8, 64), Q.Q8_0)
    with pytest.raises(ValueError, match="does not fit a Q2_K weight"):
        TritonGGMLGemm()(torch.randn(2, 64), GGMLTensor(weight.blocks, Q.Q2_K, weight.shape), None)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_the_kernel_refuses_a_k_quant_row_of_part_of_a_super_block(qtype: Q) -> None:
    assert BLOCK_VALUES[qtype] == 256
    weight = random_blocks(8, 512, qtype, torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match=f"a {qtype.name} row is whole blocks of 256 values; k = 288 is not a"):
        TritonGGMLGemm()(torch.randn(2, 288), GGMLTensor(weight.blocks, qtype, (8, 288)), None)


def test_cuda_keeps_every_type_of_a_q4_k_m_file() -> None:
    """What the loader hands out as blocks on CUDA: Gemma 3's Q4_K_M file holds Q4_K, Q6_K, Q5_0 and Q8_0."""
    assert kept_block_types(torch.device("cuda")) == TRITON_TYPES >= {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q8_0}


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama laid out as a Q4_K_M file is (Gemma 3's mixes these types): Q4_K, Q5_K and Q6_K where a row
    is whole super-blocks (random blocks, scales of about 0.001), Q5_0 and Q8_0 blocks of gguf's quantization;
    q and k Q5_0 with v Q8_0, as in Gemma 3's layers whose v is Q8_0: the packed qkv layer keeps both types."""
    model = tiny_llama(vocab_size=len(byte_level_tokens()[0]), hidden_size=256, intermediate_size=512,
                       num_hidden_layers=1)
    gen = torch.Generator().manual_seed(8)
    qtypes = {"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_K, "gate_proj": Q.Q5_K,
              "up_proj": Q.Q5_K, "down_proj": Q.Q6_K, "lm_head": Q.Q6_K, "embed_tokens": Q.Q8_0}
    blocks = {}
    for name, tensor in model.state_dict().items():
        qtype = next((qtype for part, qtype in qtypes.items() if part in name), None)
        if qtype in K_TYPES:
            blocks[name] = random_blocks(*tensor.shape, qtype, gen, scale=1e-3)
        elif qtype is not None:
            blocks[name] = blocks_of(tensor, qtype)
    return write_gguf(tmp_path_factory.mktemp("k") / "tiny-q4_k_m.gguf", model, blocks=blocks)


def test_a_k_quant_model_keeps_its_blocks_and_gives_the_dequantized_files_logits(k_quant_gguf: Path) -> None:
    """The model as ``load_model`` builds it on CUDA (``GGMLLinearMethod`` on ``TritonGGMLGemm``, the kernel's
    types kept), against the plain model on the same file dequantized: a prefill of 5 tokens and a decode."""
    checkpoint = load_checkpoint(gguf_location(k_quant_gguf), torch.float32)
    backend = TorchRefBackend()
    kept = build_model(checkpoint.hf_config, backend, torch.float32, DEVICE,
                       GGMLLinearMethod(TritonGGMLGemm(), UnquantizedLinearMethod(), keep_dense=False))
    kept.load_weights(checkpoint.weights(TRITON_TYPES))
    dense = build_model(checkpoint.hf_config, backend, torch.float32, DEVICE)
    dense.load_weights(checkpoint.weights())
    for model in (kept, dense):
        process_weights_after_loading(model)
    layer = kept.layers[0]
    held = {name: [part.qtype for part in linear.ggml_parts] if linear.ggml_parts else None for name, linear in
            (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj), ("gate_up", layer.mlp.gate_up_proj),
             ("down", layer.mlp.down_proj), ("head", kept.lm_head))}
    assert held == {"qkv": [Q.Q5_0, Q.Q5_0, Q.Q8_0], "o": [Q.Q4_K], "gate_up": [Q.Q5_K, Q.Q5_K], "down": [Q.Q6_K], "head": [Q.Q6_K]}
    runners = [PagedRunner(model.eval(), backend, 1, 16) for model in (kept, dense)]
    prompt = [5, 9, 30, 31, 40, 77]
    for chunk in (prompt[:-1], prompt[-1:]):
        logits, expected = (runner.step({0: chunk})[0] for runner in runners)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="needs CUDA")
# the K-quant file's qkv mixes Q5_0 (q, k) and Q8_0 (v): kept in runs of one type, each in blocks
@pytest.mark.parametrize("file, kept_types", [("quantized_gguf", "Q4_1"),
                                              ("k_quant_gguf", "Q4_K, Q5_0, Q5_K, Q6_K, Q8_0")])
def test_an_engine_on_cuda_keeps_the_blocks_and_agrees_with_the_dequantized_file(
    file: str, kept_types: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(file)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 30, 31, 40]}, {"prompt_token_ids": [7] * 3}]
    kept = LLM(str(path), num_kv_blocks=64, device="cuda", dtype="float32", quantization="gguf")
    dense = LLM(str(path), num_kv_blocks=64, device="cuda", dtype="float32")
    assert kept.stats()["weights_format"] == f"gguf {kept_types}" and dense.stats()["weights_format"] == "float32"
    assert ([o.outputs[0].token_ids for o in kept.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in dense.generate(prompts, params)])
