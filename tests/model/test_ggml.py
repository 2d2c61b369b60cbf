"""GGUF blocks kept quantized: the block kernel against gguf's dequantize-then-matmul twin, the linear method's
choice per layer and per step size, the loader handing out blocks in Hugging Face row order, and an engine on a
quantized GGUF against the same file dequantized."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from kvserve import LLM, SamplingParams, native
from kvserve.model.layers import ggml
from kvserve.model.layers.ggml import (
    GGML_MAX_ROWS, KERNEL_TYPES, GGMLGemm, GGMLLinearMethod, GGMLTensor,
)
from kvserve.model.layers.ggml_qdot import QDotGemm
from kvserve.model.layers.linear import PackedLinear, UnquantizedLinearMethod
from kvserve.model.loader import load_checkpoint
from tests.model.test_loader import byte_level_tokens, gguf_location, tiny_llama, write_gguf
from tests.isa_builds import cpu_flags, isa_build

K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # blocks of 256 values that gguf-py does not quantize
TYPES = sorted(KERNEL_TYPES - set(K_TYPES))  # blocks of 32 that it does
# where a block's fp16 scales sit (d, and m or dmin; Q6_K: d): random bytes there could be inf or NaN
HALF_OFFSETS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
                Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def blocks_of(weight: torch.Tensor, qtype: Q) -> GGMLTensor:
    return GGMLTensor.from_numpy(gguf.quants.quantize(weight.numpy(), qtype), qtype)


def random_blocks(n: int, k: int, qtype: Q, gen: torch.Generator, scale: float = 0.01) -> GGMLTensor:
    """A valid [n, k] weight of random blocks: random bytes (every bit pattern of the quants), with finite fp16
    scales of about ``scale``."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (n, k // block_size, block_bytes), dtype=torch.uint8, generator=gen)
    for offset in HALF_OFFSETS[qtype]:
        scales = (torch.rand(n, k // block_size, 1, generator=gen) * 2 * scale).to(torch.float16)
        blocks[..., offset : offset + 2] = scales.view(torch.uint8)
    return GGMLTensor(blocks.reshape(n, -1), qtype, (n, k))


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None) -> None:
    """Within fp32 rounding of the reference: the kernel sums d * (x . q) per block where the reference sums
    x * (d * q + m), so the bound scales with |x| . |w| (every term's magnitude), not with |y|."""
    dense = weight.dequantize()
    reference = ggml.reference_linear(x, weight, bias)
    scale = x.abs() @ dense.abs().T + (0 if bias is None else bias.abs())
    assert y.shape == reference.shape
    assert ((y - reference).abs() <= 2e-6 * scale + 1e-6).all(), float((y - reference).abs().max())


@pytest.fixture(scope="module")
def kernel() -> GGMLGemm:
    return GGMLGemm()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n, k", [(7, 32), (33, 96), (130, 160)])
def test_kernel_equals_dequantize_then_matmul(kernel: GGMLGemm, qtype: Q, rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    weight = blocks_of(torch.randn(n, k, generator=gen), qtype)
    x = torch.randn(rows, k + 16, generator=gen)[:, 8 : 8 + k]  # strided rows, as the layers' slices are
    bias = torch.randn(n, generator=gen) if rows % 2 else None
    assert_close_to_reference(kernel(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n, k", [(7, 256), (33, 512), (130, 1280)])
def test_kernel_on_k_quants_equals_dequantize_then_matmul(kernel: GGMLGemm, qtype: Q, rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    weight = random_blocks(n, k, qtype, gen)
    x = torch.randn(rows, k + 16, generator=gen)[:, 8 : 8 + k]
    bias = torch.randn(n, generator=gen) if rows % 2 else None
    assert_close_to_reference(kernel(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [0, 1, 8, 9, 15, 16, 17, 33, 70, 255, 256, 257])
def test_batched_product_equals_dequantize_then_matmul(kernel: GGMLGemm, qtype: Q, rows: int) -> None:
    """Without a dense copy: the rows kernel up to 8 rows, then the strips kernel (13 columns: a last strip of 1,
    on AVX-512 and AVX2); into a column range of a wider output, as a packed layer's projections are."""
    gen = torch.Generator().manual_seed(rows)
    k = 512 if qtype in K_TYPES else 96
    weight = random_blocks(13, k, qtype, gen) if qtype in K_TYPES else blocks_of(torch.randn(13, k, generator=gen), qtype)
    x = torch.randn(rows, k + 16, generator=gen)[:, 8 : 8 + k]
    bias = torch.randn(13, generator=gen) if rows % 2 else None
    wide = torch.full((rows, 20), float("nan"))
    kernel.batched(x, weight, bias, out=wide[:, 3:16])
    assert_close_to_reference(wide[:, 3:16], x, weight, bias)
    assert wide[:, :3].isnan().all() and wide[:, 16:].isnan().all()  # nothing written outside its columns


@pytest.fixture(params=[1, 2, 3])
def num_threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_strips_kernel_in_buffers_of_columns_and_passes_of_rows(kernel: GGMLGemm, num_threads: int) -> None:
    """A thread's strips go to y a buffer of columns at a time (16 strips): 413 columns are several buffers and a
    partial one per thread, into a column range of a wider output whose rows are 4 KiB apart; at k = 2,048 a pass
    of x is 32 rows (256 KiB), so 40 and 100 rows take several, the last partial."""
    gen = torch.Generator().manual_seed(num_threads)
    weight = blocks_of(torch.randn(413, 2048, generator=gen), Q.Q4_1)
    bias = torch.randn(413, generator=gen)
    for rows in (9, 17, 40, 100):
        x = torch.randn(rows, 2048, generator=gen)
        wide = torch.full((rows, 1024), float("nan"))
        kernel.batched(x, weight, bias, out=wide[:, 300:713])
        assert_close_to_reference(wide[:, 300:713], x, weight, bias)
        assert wide[:, :300].isnan().all() and wide[:, 713:].isnan().all()


def assert_build_equals_the_reference(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel built for ``isa`` (``$KVSERVE_CPU_ISA``), on every type it reads."""
    monkeypatch.setenv(native.ISA_ENV_VAR, isa)
    build = GGMLGemm(ctypes.CDLL(str(native.library_path(ggml.GGML_GEMM_SOURCE, batch_invariant=False))))
    gen = torch.Generator().manual_seed(1)
    weights = [blocks_of(torch.randn(19, 512, generator=gen), qtype) for qtype in TYPES]
    weights += [random_blocks(19, 512, qtype, gen) for qtype in K_TYPES]
    for weight in weights:
        x = torch.randn(5, 512, generator=gen)
        assert_close_to_reference(build(x, weight, None), x, weight, None)
        x = torch.randn(37, 512, generator=gen)  # the strips kernel: two vectors of rows and a partial one
        assert_close_to_reference(build.batched(x, weight, None), x, weight, None)
        assert_close_to_reference(build(x, weight, None), x, weight, None)  # the rows kernel at as many rows
        torch.testing.assert_close(build.dequantize(weight), weight.dequantize(), rtol=2.4e-7, atol=1e-30)


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="this CPU cannot run the AVX2 build")
def test_the_avx2_build_asked_for_on_any_cpu_equals_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_build_equals_the_reference("avx2", monkeypatch)


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="this CPU cannot run the AVX-512 build")
def test_the_avx512_build_equals_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_build_equals_the_reference("avx512", monkeypatch)


def test_kernel_refuses_what_it_cannot_read(kernel: GGMLGemm) -> None:
    weight = blocks_of(torch.randn(8, 64), Q.Q8_0)
    with pytest.raises(ValueError, match="does not fit a Q8_0 weight"):
        kernel(torch.randn(2, 32), weight, None)
    with pytest.raises(ValueError, match="Q2_K"):
        kernel(torch.randn(2, 64), GGMLTensor(weight.blocks, Q.Q2_K, weight.shape), None)


def packed_layer(parts: dict[str, GGMLTensor | torch.Tensor], method: GGMLLinearMethod) -> PackedLinear:
    layer = PackedLinear(64, {name: part.shape[0] for name, part in parts.items()}, bias=False)
    layer.bind(method, torch.float32)
    for name, part in parts.items():
        layer.load_weight("weight", part, shard=name)
    layer.process_weights_after_loading()
    return layer


@pytest.fixture
def method(kernel: GGMLGemm) -> GGMLLinearMethod:
    return GGMLLinearMethod(kernel, UnquantizedLinearMethod())


def test_a_packed_layer_of_one_block_type_keeps_its_blocks(method: GGMLLinearMethod) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k = blocks_of(torch.randn(32, 64, generator=gen), Q.Q4_1), blocks_of(torch.randn(16, 64, generator=gen), Q.Q4_1)
    layer = packed_layer({"q_proj": q, "k_proj": k}, method)
    (joined,) = layer.ggml_parts
    assert joined.qtype == Q.Q4_1 and layer.weight.shape == (48, 64)  # the dense copy for larger steps
    dense = torch.cat([q.dequantize(), k.dequantize()])
    assert torch.equal(joined.dequantize(), dense)
    for rows in (1, GGML_MAX_ROWS, GGML_MAX_ROWS + 1, 17):  # the kernel, then the dense layout
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(layer(x), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_without_a_dense_copy_a_packed_layer_multiplies_its_projections_where_they_were_loaded(
    kernel: GGMLGemm,
) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k = blocks_of(torch.randn(32, 64, generator=gen), Q.Q4_1), blocks_of(torch.randn(16, 64, generator=gen), Q.Q4_1)
    layer = packed_layer({"q_proj": q, "k_proj": k}, GGMLLinearMethod(kernel, UnquantizedLinearMethod(), keep_dense=False))
    assert [part.blocks.data_ptr() for part in layer.ggml_parts] == [q.blocks.data_ptr(), k.blocks.data_ptr()]
    assert layer.weight.numel() == 0  # no dense copy
    dense = torch.cat([q.dequantize(), k.dequantize()])
    for rows in (1, GGML_MAX_ROWS + 1, 17, 259):  # the rows kernel, the strips kernel
        x = torch.randn(2, rows, 64, generator=gen)
        torch.testing.assert_close(layer(x), x @ dense.T, rtol=1e-5, atol=1e-5)


def isa_kernel(isa: str) -> GGMLGemm:
    """The exact kernel built for ``isa``; skips where this CPU cannot run that build."""
    return GGMLGemm(isa_build(ggml.GGML_GEMM_SOURCE, isa, batch_invariant=False))


@pytest.mark.parametrize("isa, q_and_k", [("avx2", Q.Q8_0), ("avx512", Q.Q5_0)])
def test_the_builds_fastest_layout_keeps_the_values(isa: str, q_and_k: Q) -> None:
    """The AVX2 build multiplies Q5_0 faster as Q8_0 blocks, which hold exactly its values; the AVX-512 build
    and every other type keep the blocks as they are."""
    build = isa_kernel(isa)
    gen = torch.Generator().manual_seed(6)
    for qtype in TYPES + K_TYPES:
        weight = random_blocks(9, 256, qtype, gen)
        laid_out = build.fastest_layout(weight)
        if qtype != Q.Q5_0 or q_and_k == Q.Q5_0:
            assert laid_out is weight
            continue
        assert laid_out.qtype == Q.Q8_0 and laid_out.shape == weight.shape
        assert torch.equal(laid_out.dequantize(), weight.dequantize())  # lossless
        x = torch.randn(3, 256, generator=gen)
        assert_close_to_reference(build(x, laid_out, None), x, weight, None)


@pytest.mark.parametrize("isa, q_and_k", [("avx2", Q.Q8_0), ("avx512", Q.Q5_0)])
def test_a_packed_layer_of_mixed_block_types_keeps_one_tensor_per_run_of_a_type(isa: str, q_and_k: Q) -> None:
    """Gemma 3's qkv: q and k Q5_0, v Q8_0. Kept as two tensors of blocks (q and k joined), not dequantized; the
    AVX2 build takes q and k as Q8_0 (its fastest layout), so all three join."""
    build = isa_kernel(isa)
    gen = torch.Generator().manual_seed(4)
    parts = {"q_proj": blocks_of(torch.randn(32, 64, generator=gen), Q.Q5_0),
             "k_proj": blocks_of(torch.randn(16, 64, generator=gen), Q.Q5_0),
             "v_proj": blocks_of(torch.randn(16, 64, generator=gen), Q.Q8_0)}
    layer = packed_layer(parts, GGMLLinearMethod(build, UnquantizedLinearMethod()))
    kept = [(part.qtype, part.shape) for part in layer.ggml_parts]
    assert kept == ([(Q.Q5_0, (48, 64)), (Q.Q8_0, (16, 64))] if q_and_k == Q.Q5_0 else [(Q.Q8_0, (64, 64))])
    dense = torch.cat([part.dequantize() for part in parts.values()])
    assert torch.equal(layer.weight, dense)  # the dense copy for larger steps
    for rows in (1, GGML_MAX_ROWS, GGML_MAX_ROWS + 1, 17):  # the kernel into column ranges, then the dense layout
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(layer(x), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_the_int8_kernel_and_a_mapped_file_keep_q5_0_as_loaded() -> None:
    """Q5_0 is converted only for the exact kernel, and only where copies are kept: the int8-activation kernel
    multiplies Q5_0 as fast as Q8_0, and a mapped file's blocks stay its own pages."""
    build = isa_kernel("avx2")
    gen = torch.Generator().manual_seed(7)
    q = blocks_of(torch.randn(32, 64, generator=gen), Q.Q5_0)
    for method in (GGMLLinearMethod(build, UnquantizedLinearMethod(), keep_dense=False),
                   GGMLLinearMethod(build, UnquantizedLinearMethod(), QDotGemm())):
        layer = packed_layer({"q_proj": q}, method)
        assert [part.qtype for part in layer.ggml_parts] == [Q.Q5_0]


def test_a_layer_of_blocks_and_floats_is_dequantized_for_the_dense_method(method: GGMLLinearMethod) -> None:
    gen = torch.Generator().manual_seed(3)
    q = blocks_of(torch.randn(32, 64, generator=gen), Q.Q4_0)
    k = torch.randn(16, 64, generator=gen)
    layer = packed_layer({"q_proj": q, "k_proj": k}, method)
    assert layer.ggml_parts is None
    x = torch.randn(2, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ torch.cat([q.dequantize(), k]).T)


def test_a_part_of_the_wrong_shape_names_both_shapes(method: GGMLLinearMethod) -> None:
    layer = PackedLinear(64, {"q_proj": 32}, bias=False)
    layer.bind(method, torch.float32)
    with pytest.raises(ValueError, match=r"\[16, 64\].*\[32, 64\]"):
        layer.load_weight("weight", blocks_of(torch.randn(16, 64), Q.Q8_0), shard="q_proj")


@pytest.fixture(scope="module")
def quantized_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama's 2-D tensors in blocks of one type: Q4_1, or the type a test parametrizes it with."""
    qtype = getattr(request, "param", Q.Q4_1)
    model = tiny_llama(vocab_size=len(byte_level_tokens()[0]))
    return write_gguf(tmp_path_factory.mktemp("q") / f"tiny-{qtype.name.lower()}.gguf", model, qtype=qtype)


# Gemma 3's Q4_K_M file keeps Q5_0 where its width (640) is no whole number of K-quant blocks
FILE_TYPES = pytest.mark.parametrize("quantized_gguf", [Q.Q4_1, Q.Q5_0, Q.Q5_1], indirect=True,
                                     ids=lambda t: t.name)


@FILE_TYPES
def test_the_loader_hands_out_blocks_in_hugging_face_row_order(quantized_gguf: Path) -> None:
    checkpoint = load_checkpoint(gguf_location(quantized_gguf), torch.float32)
    dequantized = dict(checkpoint.weights())
    kept = dict(checkpoint.weights(KERNEL_TYPES))
    assert kept.keys() == dequantized.keys()
    blocks = {name: t for name, t in kept.items() if isinstance(t, GGMLTensor)}
    assert "model.layers.0.self_attn.q_proj.weight" in blocks and "model.layers.1.mlp.down_proj.weight" in blocks
    for name, tensor in kept.items():  # q and k rows un-permuted as whole runs of blocks
        expected = dequantized[name]
        assert torch.equal(tensor.dequantize() if name in blocks else tensor, expected), name


@FILE_TYPES
def test_an_engine_keeps_the_blocks_and_agrees_with_the_dequantized_file(quantized_gguf: Path) -> None:
    """The exact path (fp32 activations) within fp32 rounding of the dequantized file; the default int8
    activations within 0.02 of its logprobs (measured 0.003) on this tiny random model."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5, 9, 30, 31, 40]}, {"prompt_token_ids": [7] * 3}]
    runs, activations = {}, {}
    for name, options in {"exact": {}, "int8": {"quantize_activations": True}, "none": {"quantization": "none"}}.items():
        llm = LLM(str(quantized_gguf), num_kv_blocks=64, **options)
        runs[name] = (llm.stats()["weights_format"], llm.generate(prompts, params))
        activations[name] = llm.stats()["activations_format"]
    assert activations == {"exact": "float32", "int8": "int8 into the linear layers (float32 elsewhere)",
                           "none": "float32"}
    with pytest.raises(ValueError, match="quantize_activations .* not to dense weights on cpu"):
        LLM(str(quantized_gguf), num_kv_blocks=64, quantization="none", quantize_activations=True)
    qtype = quantized_gguf.stem.removeprefix("tiny-").upper()
    held = GGMLGemm().layout_type(Q[qtype]).name  # the exact kernel's AVX2 build holds Q5_0 as Q8_0
    assert runs["exact"][0] == f"gguf {held}" and runs["none"][0] == "float32"
    # the int8 kernel keeps the file's blocks; a layer it leaves to the exact kernel may hold that kernel's layout
    assert qtype in set(runs["int8"][0].removeprefix("gguf ").split(", ")) <= {qtype, held}
    for exact, int8, dense in zip(runs["exact"][1], runs["int8"][1], runs["none"][1]):
        assert exact.outputs[0].token_ids == dense.outputs[0].token_ids
        dense_lp = [next(iter(step.values())).logprob for step in dense.outputs[0].logprobs]
        exact_lp = [next(iter(step.values())).logprob for step in exact.outputs[0].logprobs]
        np.testing.assert_allclose(exact_lp, dense_lp, atol=1e-4)
        # teacher-forced on the dense tokens (the int8 path's own greedy tokens may part where logits are close),
        # in chunks of 2 tokens so that every step runs the block kernel
        forced = LLM(str(quantized_gguf), num_kv_blocks=64, max_num_batched_tokens=2, quantize_activations=True).generate(
            [{"prompt_token_ids": dense.prompt_token_ids + list(dense.outputs[0].token_ids)}],
            SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        int8_lp = [next(iter(step.values())).logprob for step in forced.prompt_logprobs[len(dense.prompt_token_ids):]]
        assert max(abs(a - b) for a, b in zip(int8_lp, dense_lp)) > 1e-6  # the int8 path ran
        np.testing.assert_allclose(int8_lp, dense_lp, atol=0.02)


def test_quantization_gguf_says_why_it_cannot_keep_blocks(tmp_path: Path) -> None:
    model = tiny_llama(vocab_size=len(byte_level_tokens()[0]))
    plain = write_gguf(tmp_path / "tiny-f32.gguf", model)
    with pytest.raises(ValueError, match="quantization='gguf'"):
        LLM(str(plain), quantization="gguf", dtype="bfloat16", num_kv_blocks=16)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM(str(plain), quantization="int3")


def test_a_type_the_kernel_does_not_read_is_refused_where_blocks_are_promised(tmp_path: Path, caplog) -> None:
    """``quantization='gguf'`` and ``load_format='mmap'`` promise the file's blocks: a matrix the kernel cannot
    read (IQ4_NL here) would be a dequantized copy, so they refuse, naming it; ``auto`` dequantizes it, saying so."""
    model = tiny_llama(vocab_size=len(byte_level_tokens()[0]))
    down = "model.layers.0.mlp.down_proj.weight"
    rows, cols = model.state_dict()[down].shape
    values, size = GGML_QUANT_SIZES[Q.IQ4_NL]
    odd = ggml.GGMLTensor.from_numpy(np.zeros((rows, cols // values * size), np.uint8), Q.IQ4_NL)
    path = write_gguf(tmp_path / "tiny-iq4nl.gguf", model, qtype=Q.Q8_0, blocks={down: odd})
    for options in ({"quantization": "gguf"}, {"load_format": "mmap"}):
        with pytest.raises(ValueError, match=r"does not read IQ4_NL \(blk.0.ffn_down.weight\)"):
            LLM(str(path), num_kv_blocks=16, **options)
    with caplog.at_level("WARNING", logger="kvserve.model.registry"):
        llm = LLM(str(path), num_kv_blocks=16)
    assert "IQ4_NL (blk.0.ffn_down.weight): dequantized at load" in caplog.text
    assert llm.stats()["weights_format"] == "gguf Q8_0"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernels_dequantization_equals_ggufs(kernel: GGMLGemm, qtype: Q) -> None:
    weight = blocks_of(torch.randn(37, 96, generator=torch.Generator().manual_seed(4)), qtype)
    # one rounding apart at most: the kernel may fuse d * q + m into one multiply-add
    torch.testing.assert_close(kernel.dequantize(weight), weight.dequantize(), rtol=2.4e-7, atol=1e-30)
    with pytest.raises(ValueError, match="not a contiguous fp32"):
        kernel.dequantize(weight, torch.empty(36, 96))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_the_kernels_k_quant_dequantization_equals_ggufs(kernel: GGMLGemm, qtype: Q) -> None:
    weight = random_blocks(37, 768, qtype, torch.Generator().manual_seed(4))
    torch.testing.assert_close(kernel.dequantize(weight), weight.dequantize(), rtol=2.4e-7, atol=1e-30)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernels_dequantization_of_random_blocks_of_32_is_ggufs_bit_for_bit(kernel: GGMLGemm, qtype: Q) -> None:
    """Every bit pattern of the quants (Q5_0 / Q5_1: of qh's fifth bits too), scales from 1e-6 to 1e3. Bit for
    bit: d * q is exact in fp32 (an 11-bit fp16 mantissa times at most 8 bits), so d * q + offset rounds once
    whether fused or not, as gguf's d * q + m does (and d * (q - 8), d * (q - 16) are exact)."""
    gen = torch.Generator().manual_seed(6)
    for scale in (1e-6, 0.01, 1e3):
        weight = random_blocks(41, 320, qtype, gen, scale)
        assert torch.equal(kernel.dequantize(weight), weight.dequantize())


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps ``path``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path.resolve())):
            start, stop = line.split()[0].split("-")
            ranges.append((int(start, 16), int(stop, 16)))
    return ranges


def test_load_format_mmap_runs_the_files_own_blocks_and_agrees_with_auto(quantized_gguf: Path) -> None:
    """No copy of the weights but where the loader had to reorder rows (Llama's q and k): the embeddings and
    the other layers run on the file's mapped pages; steps of 1 to 35 tokens (the rows kernel, the strips
    kernel) give auto's tokens, within fp32 rounding of its logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5, 9, 30, 31, 40] * 7}, {"prompt_token_ids": [7] * 3}]
    auto = LLM(str(quantized_gguf), num_kv_blocks=64)
    mapped = LLM(str(quantized_gguf), num_kv_blocks=64, load_format="mmap")
    assert mapped.stats()["weights_format"] == "gguf Q4_1 (mapped)"
    assert mapped.stats()["weights_bytes"] < auto.stats()["weights_bytes"] / 3
    model = mapped.engine.core.runner.model
    ranges = mapped_ranges(quantized_gguf)
    in_file = lambda tensor: any(start <= tensor.data_ptr() < stop for start, stop in ranges)  # noqa: E731
    assert in_file(model.embed_tokens.ggml_weight.blocks) and model.embed_tokens.weight.numel() == 0
    assert all(in_file(part.blocks) for part in model.layers[0].mlp.down_proj.ggml_parts)
    for a, b in zip(auto.generate(prompts, params), mapped.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose([next(iter(s.values())).logprob for s in b.outputs[0].logprobs],
                                   [next(iter(s.values())).logprob for s in a.outputs[0].logprobs], atol=1e-4)


@pytest.mark.parametrize("options, reason", [
    ({"quantization": "none"}, "quantization='none' lays the weights out anew"),
    ({"quantization": "int8"}, "quantization='int8' lays the weights out anew"),
    ({"dtype": "bfloat16"}, "dtype=bfloat16 dequantizes the blocks"),
])
def test_load_format_mmap_refuses_what_it_cannot_map(quantized_gguf: Path, options: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=f"load_format='mmap' .*{reason}"):
        LLM(str(quantized_gguf), num_kv_blocks=64, load_format="mmap", **options)
