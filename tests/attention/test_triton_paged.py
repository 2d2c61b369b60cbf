"""TritonPagedBackend against TorchRefBackend: through Triton's interpreter on CPU (small shapes: it runs each
program in numpy), natively on CUDA where there is one (``-m gpu`` adds real shapes)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA

from kvserve.attention.backend import shared_prefixes  # noqa: E402
from kvserve.attention.selector import select_backend  # noqa: E402
from kvserve.attention.torch_ref import TorchRefBackend  # noqa: E402
from kvserve.attention import triton_paged  # noqa: E402
from kvserve.attention.triton_paged import TritonPagedBackend, is_interpreted, store_kv  # noqa: E402
from kvserve.kv.quant import ENCODINGS  # noqa: E402
from kvserve.model.layers.triton_fused_ops import TritonFusedOps  # noqa: E402
from tests.attention.test_cpu_paged import make_step, share_leading_blocks  # noqa: E402
from tests.attention.test_torch_ref import LAYER, Step, null_dead_blocks  # noqa: E402

DEVICE = "cpu" if is_interpreted() else "cuda"
# fp32 runs ieee dots, so it lands on the reference up to summation order; bf16 rounds the probabilities to bf16
# before the P @ V dot, as SDPA's flash kernels do, about 2^-8 relative.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
NO_SPLIT, SPLIT = TritonPagedBackend(max_kv_splits=1), TritonPagedBackend(max_kv_splits=4)
MIXED = [(0, 1), (70, 1), (130, 1), (5, 1), (0, 19), (37, 11), (200, 3)]  # 4 decodes, then 3 chunks


def check(step: Step, window: int | None, backend: TritonPagedBackend) -> None:
    """The Triton backend equals the reference backend on the same step (each writes the same new K/V at the
    same slots, so the cache is shared)."""
    scale = step.q.shape[-1] ** -0.5
    outs = []
    for b in (backend, TorchRefBackend()):
        meta = b.build_metadata(step.inputs, {None, window})
        outs.append(b.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=scale, sliding_window=window))
    fast, reference = outs
    assert fast.shape == step.q.shape and fast.dtype == step.q.dtype
    tol = TOLERANCE[step.q.dtype]
    torch.testing.assert_close(fast.float(), reference.float(), atol=tol, rtol=tol)


def triton_step(seqs: list[tuple[int, int]], num_decodes: int, **kwargs) -> Step:
    kwargs = {"head_dim": 64, "block_size": 16, "num_kv_heads": 2, "device": DEVICE, **kwargs}
    return make_step(seqs, num_decodes, **kwargs)


@pytest.mark.parametrize("merge_in_decode", [True, False], ids=["merged_in_decode", "merge_kernel"])
@pytest.mark.parametrize("backend", [NO_SPLIT, SPLIT], ids=["one_split", "split_kv"])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("group", [1, 3])
def test_decodes(group: int, window: int | None, backend: TritonPagedBackend, merge_in_decode: bool,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes of 1 to 300 keys: splits longer and shorter than a tile, empty splits of short decodes, windows
    that cut inside a block; the splits merged by the decode launch's last program, or by a kernel of their own."""
    monkeypatch.setattr(triton_paged, "MERGE_IN_DECODE", merge_in_decode)
    contexts = [0, 1, 63, 64, 150, 299]
    check(triton_step([(c, 1) for c in contexts], len(contexts), group=group, seed=group), window, backend)


def with_shared_prefix(step: Step, max_shared: int | None = None) -> Step:
    """The step's inputs carrying the keys its decodes share with their groups, as the runner computes them;
    ``max_shared``: the bound metadata assumes (a graph's: any), default the largest."""
    num_decodes, inputs = step.inputs.num_decodes, step.inputs
    lens, order = shared_prefixes(inputs.block_tables[:num_decodes].cpu().numpy(),
                                  inputs.seq_lens[:num_decodes].cpu().numpy(), inputs.block_size)
    return replace(step, inputs=replace(
        inputs, shared_prefix_lens=torch.from_numpy(lens).to(DEVICE), sharing_order=torch.from_numpy(order).to(DEVICE),
        max_shared_prefix_len=int(lens.max(initial=0)) if max_shared is None else max_shared))


CASCADE_CONTEXTS = [150 + 7 * i for i in range(17)] + [129]  # 18 decodes: more than a tile of 64 query rows


@pytest.mark.parametrize("merge_in_decode", [True, False], ids=["merged_in_decode", "merge_kernel"])
@pytest.mark.parametrize("window", [None, 60])
def test_decodes_sharing_a_prefix_attend_it_once_for_all(window: int | None, merge_in_decode: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """18 decodes mixed with a chunk: 10 share their first 8 blocks (128 keys; more members than a tile of 64
    query rows takes), 5 others share 5 blocks, one of them 12 with another, and 3 share nothing. Each group's
    keys go through cascade_prefix_kernel a run of its members at a time (one tile holds the end of a group and
    the start of the next), the rest through the decode kernel after them (a windowed layer's decodes attend
    alone, as the reference does either way)."""
    monkeypatch.setattr(triton_paged, "MERGE_IN_DECODE", merge_in_decode)
    step = triton_step([(c, 1) for c in CASCADE_CONTEXTS] + [(40, 9)], len(CASCADE_CONTEXTS), group=4, seed=12)
    step = share_leading_blocks(step, [([3, 0, 1, 2, 4, 5, 6, 7, 8, 9], 8), ([17, 10, 11, 12, 13], 5),
                                       ([10, 11], 12)])
    step = with_shared_prefix(step)
    lens = step.inputs.shared_prefix_lens.tolist()
    assert lens[:10] == [128] * 10 and lens[10:14] == [80] * 4 and lens[17] == 80 and lens[14:17] == [0] * 3
    meta = SPLIT.build_metadata(step.inputs, {None, window})
    assert meta.cascade_splits == 2
    check(step, window, SPLIT)


def test_shared_prefixes_group_decodes_by_their_first_block() -> None:
    """A group's share stops at its first block that differs and at the blocks complete before every member's
    own key; the order keeps each group together."""
    tables = np.array([[5, 6, 7, 8], [1, 2, 3, 0], [5, 6, 9, 0], [1, 2, 3, 4], [2, 0, 0, 0], [5, 6, 7, 0]])
    seq_lens = np.array([60, 41, 40, 64, 3, 49])  # block_size 16: complete blocks 3, 2, 2, 3, 0, 3
    lens, order = shared_prefixes(tables, seq_lens, 16)
    assert lens.tolist() == [32, 32, 32, 32, 0, 32]
    assert [tables[i, 0] for i in order] == [1, 1, 2, 5, 5, 5]
    assert shared_prefixes(tables[:1], seq_lens[:1], 16)[0].tolist() == [0]


def test_cascade_metadata_for_any_step_serves_one_that_shares_nothing() -> None:
    """A graph's metadata is built for whatever its later steps share: in a step whose decodes share nothing
    the prefix kernel's programs store empty states, which the merge weighs 0."""
    step = triton_step([(c, 1) for c in CASCADE_CONTEXTS], len(CASCADE_CONTEXTS), group=2, seed=13)
    step = with_shared_prefix(step, max_shared=512)
    assert not step.inputs.shared_prefix_lens.any() and SPLIT.build_metadata(step.inputs, {None}).cascade_splits
    check(step, None, SPLIT)


def test_split_counters_are_zero_again_after_each_launch() -> None:
    """The last split of each (decode, KV head) zeroes its counter, so that the next layer's and the next step's
    launches (a CUDA graph replays the same buffer) merge again: the same step twice gives the same output."""
    backend = TritonPagedBackend(max_kv_splits=4)
    step = triton_step([(c, 1) for c in (150, 299, 64)], 3, group=2, seed=11)
    meta = backend.build_metadata(step.inputs, {None})
    first, second = (backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=0.125) for _ in range(2))
    counters = backend._counters[step.q.device]
    assert counters.numel() >= 3 * step.k.shape[1] and not counters.any()
    assert torch.equal(first, second)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_chunks_with_and_without_context(group: int, window: int | None) -> None:
    """Chunks of 1, 23 and 70 tokens (more than a 64-row tile) on contexts of 0, 19 and 100."""
    seqs = [(0, 23), (19, 13), (100, 70), (0, 1), (45, 1)]
    check(triton_step(seqs, 0, group=group, seed=10 + group), window, SPLIT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 33])
def test_mixed_decodes_and_chunks(dtype: torch.dtype, window: int | None) -> None:
    check(triton_step(MIXED, 4, group=3, dtype=dtype, seed=3), window, SPLIT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_writes_what_the_storage_writes(dtype: torch.dtype) -> None:
    """The one-launch store of an unquantized cache leaves it bit for bit as ``KVCacheStorage.write`` does, from
    k / v as the model passes them (column slices of the packed qkv rows)."""
    step = triton_step(MIXED, 4, group=3, dtype=dtype, seed=7)
    view, slots = step.kv.layer(LAYER), step.inputs.slot_mapping
    num_heads, num_kv_heads = step.q.shape[1], step.k.shape[1]
    qkv = torch.cat([step.q, step.k, step.v], dim=1)
    k, v = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    before = view.k.clone(), view.v.clone()
    store_kv(view, slots, k, v)
    stored = view.k.clone(), view.v.clone()
    view.k.copy_(before[0])
    view.v.copy_(before[1])
    step.kv.write(LAYER, slots, step.k, step.v)
    assert torch.equal(stored[0], view.k) and torch.equal(stored[1], view.v)
    assert not torch.equal(stored[0], before[0]) and not torch.equal(stored[1], before[1])


def rope_tables(num_tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim / 2] at random positions, in the model's dtype, as ``RotaryEmbedding`` gives."""
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=torch.Generator().manual_seed(0)) * 100
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_rotates_as_the_fused_ops_rotary_kernel(dtype: torch.dtype, head_dim: int) -> None:
    """With the rope tables the store leaves the cache and q bit for bit as the fused ops' rotary kernel followed
    by the plain store do (80: half of 40 in a 64-wide tile); k itself is left unrotated."""
    step = triton_step(MIXED, 4, group=3, dtype=dtype, head_dim=head_dim, seed=8)
    view, slots = step.kv.layer(LAYER), step.inputs.slot_mapping
    num_heads, num_kv_heads = step.q.shape[1], step.k.shape[1]
    qkv = torch.cat([step.q, step.k, step.v], dim=1)
    rope = rope_tables(qkv.shape[0], head_dim, dtype)
    fused_qkv = qkv.clone()
    q, k, v = fused_qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    store_kv(view, slots, k, v, rope, q)
    stored = view.k.clone(), view.v.clone()
    separate_qkv = qkv.clone()
    TritonFusedOps().rotary_(separate_qkv[:, : num_heads + num_kv_heads], *rope)
    q2, k2, v2 = separate_qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    store_kv(view, slots, k2, v2)
    assert torch.equal(stored[0], view.k) and torch.equal(stored[1], view.v)
    assert torch.equal(q, q2) and not torch.equal(q, step.q)
    assert torch.equal(k, step.k)


def test_backends_that_do_not_rotate_refuse_the_rope() -> None:
    step = triton_step([(3, 1), (0, 4)], 1, group=1)
    rope = rope_tables(step.q.shape[0], step.q.shape[2], step.q.dtype)
    reference = TorchRefBackend()
    assert not reference.takes_rope(step.kv, LAYER) and SPLIT.takes_rope(step.kv, LAYER)
    with pytest.raises(ValueError, match="TorchRefBackend does not rotate"):
        reference.forward(step.q, step.k, step.v, LAYER, step.kv, reference.build_metadata(step.inputs, {None}),
                          scale=1.0, rope=rope)
    quantized = triton_step([(3, 1), (0, 4)], 1, group=1, encoding=ENCODINGS["int8"])
    assert not SPLIT.takes_rope(quantized.kv, LAYER)  # KVCacheStorage.write quantizes: the layer rotates
    with pytest.raises(ValueError, match="TritonPagedBackend does not rotate"):
        SPLIT.forward(quantized.q, quantized.k, quantized.v, LAYER, quantized.kv,
                      SPLIT.build_metadata(quantized.inputs, {None}), scale=1.0, rope=rope)
    with pytest.raises(ValueError, match="store_kv rotates q"):
        store_kv(step.kv.layer(LAYER), step.inputs.slot_mapping, step.k, step.v, rope, None)


def test_head_dim_not_a_power_of_two() -> None:
    """head_dim 80 runs in 128-wide tiles, the last 48 columns masked."""
    check(triton_step(MIXED, 4, head_dim=80, group=3, seed=4), 40, SPLIT)


def test_strided_qkv_views_as_the_model_passes_them() -> None:
    step = triton_step([(5, 1), (90, 1), (4, 6)], 2, group=3)
    q, k, v = torch.cat([step.q, step.k, step.v], dim=1).split([6, 2, 2], dim=1)
    assert not q.is_contiguous()
    check(Step(step.inputs, step.kv, q, k, v, step.histories, step.query_lens), None, SPLIT)


@pytest.mark.parametrize("encoding", ["int8", "fp8", "int4"])
def test_quantized_cache_is_dequantized_in_the_kernels(encoding: str) -> None:
    check(triton_step(MIXED, 4, group=3, encoding=ENCODINGS[encoding], seed=5), 33, SPLIT)


@pytest.mark.parametrize("head_dim", [48, 64, 256])
def test_int4_unpacks_both_halves_of_each_group(head_dim: int) -> None:
    """int4 packs value i and value i + group / 2 of a group in one byte, each group with its own parameters
    (48: 3 groups of 16, 64: one, 256: 4 of 64), and keys rotated: a head_dim that is no power of two pads the
    tile past the packed row, which must read as zeros."""
    step = triton_step(MIXED, 4, group=2, head_dim=head_dim, encoding=ENCODINGS["int4"], seed=7)
    check(step, None, NO_SPLIT)
    check(step, None, SPLIT)


def test_unsupported_inputs_are_rejected_with_what_is_wrong() -> None:
    step = triton_step([(3, 1), (0, 4)], 1, group=1)
    meta = SPLIT.build_metadata(step.inputs, {None})
    with pytest.raises(ValueError, match="sliding_window=8"):
        SPLIT.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=1.0, sliding_window=8)
    with pytest.raises(TypeError, match="fp16 / bf16 / fp32"):
        SPLIT.forward(step.q.double(), step.k, step.v, LAYER, step.kv, meta, scale=1.0)


CUDA = torch.device("cuda")


def test_selector_picks_triton_on_cuda_where_its_kernels_read_the_cache() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert isinstance(select_backend(CUDA, dtype), TritonPagedBackend)
    for encoding in ("int8", "fp8", "int4"):
        assert isinstance(select_backend(CUDA, torch.bfloat16, kv_dtype=ENCODINGS[encoding]), TritonPagedBackend)
    assert type(select_backend(CUDA, torch.float64)) is TorchRefBackend
    with pytest.raises(ValueError, match="not torch.float64"):
        select_backend(CUDA, torch.float64, name="triton")


def test_selector_forces_triton_on_cpu_only_under_the_interpreter() -> None:
    if is_interpreted():
        assert isinstance(select_backend(torch.device("cpu"), torch.float32, "triton"), TritonPagedBackend)
    else:
        with pytest.raises(ValueError, match="under TRITON_INTERPRET=1"):
            select_backend(torch.device("cpu"), torch.float32, "triton")


def test_kvserve_imports_and_selects_without_triton() -> None:
    """With triton unimportable, the engine still imports, CUDA falls back to the reference (with a warning),
    and forcing triton raises ImportError."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kvserve, kvserve.worker.model_runner\n"
        "from kvserve.attention.selector import select_backend\n"
        "assert type(select_backend(torch.device('cuda'), torch.bfloat16)).__name__ == 'TorchRefBackend'\n"
        "try:\n    select_backend(torch.device('cuda'), torch.bfloat16, name='triton')\n"
        "except ImportError:\n    print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(is_interpreted(), reason="needs CUDA (natively compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (8, 4, 128)])
@pytest.mark.parametrize("window", [None, 500])
def test_real_shapes_on_cuda(dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int,
                             window: int | None) -> None:
    """SmolLM2's and Llama-3-8B's attention shapes, at contexts of thousands of tokens and a batch small enough
    to split the keys, beside a 1,000-token chunk and chunks on long contexts."""
    contexts = [1, 17, 700, 2048, 4000, 129, 3000, 64]
    seqs = [(c, 1) for c in contexts] + [(0, 1000), (1500, 300), (4000, 17)]
    step = triton_step(seqs, len(contexts), head_dim=head_dim, num_kv_heads=num_kv_heads, group=group,
                       dtype=dtype, seed=head_dim)
    check(step, window, TritonPagedBackend())


@pytest.mark.gpu
@pytest.mark.skipif(is_interpreted(), reason="needs CUDA (natively compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (8, 4, 128)])
def test_cascade_at_real_shapes_on_cuda(dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int) -> None:
    """64 decodes on one 1,024-token prompt (a system prompt's hits), each with 1 to 300 keys of its own,
    launched three times on one backend (the splits' counters zeroed between launches)."""
    contexts = [1024 + (37 * i) % 300 for i in range(64)]
    step = triton_step([(c, 1) for c in contexts], len(contexts), head_dim=head_dim, num_kv_heads=num_kv_heads,
                       group=group, dtype=dtype, seed=head_dim)
    step = with_shared_prefix(share_leading_blocks(step, [(list(range(len(contexts))), 64)]))
    backend = TritonPagedBackend()
    assert backend.build_metadata(step.inputs, {None}).cascade_splits > 0
    for _ in range(3):
        check(step, None, backend)


@pytest.mark.parametrize("window", [6, 40])
def test_blocks_before_every_window_may_be_null(window: int) -> None:
    step = triton_step([(50, 1), (130, 1), (3, 1), (40, 9), (100, 20)], 3, group=2)
    check(null_dead_blocks(step, window), window, NO_SPLIT)
    check(null_dead_blocks(step, window), window, SPLIT)
