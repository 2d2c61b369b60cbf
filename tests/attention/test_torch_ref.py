"""TorchRefBackend against a naive per-sequence attention over contiguous K/V histories."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.attention.backend import AttentionInputs
from kvserve.attention.torch_ref import MAX_DECODE_GROUPS_CPU, MIN_DECODE_GROUP, TorchRefBackend, _decode_groups
from kvserve.kv.groups import NULL_BLOCK
from kvserve.kv.quant import KVCacheDtype
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage

HEAD_DIM = 8
NUM_LAYERS = 2
LAYER = 1
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
])]


@dataclass
class Step:
    """A step over sequences (context_len, query_len), decodes first, with the sequences' full histories."""

    inputs: AttentionInputs
    kv: KVCacheStorage
    q: torch.Tensor  # [T, num_heads, d]: the step's queries
    k: torch.Tensor  # [T, num_kv_heads, d]: the step's new keys
    v: torch.Tensor
    histories: list[tuple[torch.Tensor, torch.Tensor]]  # per sequence: K, V [seq_len, num_kv_heads, d]
    query_lens: list[int]


def make_step(
    seqs: list[tuple[int, int]], num_decodes: int, *, block_size: int, num_kv_heads: int, group: int,
    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, encoding: KVCacheDtype | None = None,
) -> Step:
    """Random K/V histories whose contexts are already in shuffled, non-contiguous blocks of the cache, stored in
    ``encoding`` (default: ``dtype`` itself; the histories are then the values before quantization)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_per_seq = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, generator=gen).tolist()
    spec = KVCacheSpec(NUM_LAYERS, num_kv_heads, HEAD_DIM, block_size, dtype, encoding)
    kv = KVCacheStorage(spec, num_blocks, device)
    tables, histories, new_slots, qs = [], [], [], []
    for (context_len, query_len), num_seq_blocks in zip(seqs, blocks_per_seq):
        table, block_ids = block_ids[:num_seq_blocks], block_ids[num_seq_blocks:]
        tables.append(table)
        seq_len = context_len + query_len
        history = [torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype) for _ in "kv"]
        histories.append(tuple(h.to(device) for h in history))
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        context_slots = torch.tensor(slots[:context_len], dtype=torch.long, device=device)
        kv.write(LAYER, context_slots, histories[-1][0][:context_len], histories[-1][1][:context_len])
        new_slots += slots[context_len:]
        qs.append(torch.randn(query_len, num_heads, HEAD_DIM, generator=gen).to(dtype))
    width = max(len(t) for t in tables)
    query_lens = [n for _, n in seqs]
    seq_lens = [c + n for c, n in seqs]
    inputs = AttentionInputs(
        num_decodes=num_decodes,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                     device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(new_slots, dtype=torch.long, device=device),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        block_size=block_size,
    )
    k = torch.cat([h[0][c:] for h, (c, _) in zip(histories, seqs)])
    v = torch.cat([h[1][c:] for h, (c, _) in zip(histories, seqs)])
    return Step(inputs, kv, torch.cat(qs).to(device), k, v, histories, query_lens)


def naive_attention(step: Step, scale: float, window: int | None) -> torch.Tensor:
    """Per sequence, in float64: repeated KV heads, explicit causal/window mask, softmax."""
    outs, row = [], 0
    group = step.q.shape[1] // step.k.shape[1]
    for (keys, values), query_len in zip(step.histories, step.query_lens):
        seq_len = keys.shape[0]
        q = step.q[row : row + query_len].double().transpose(0, 1)  # [H, Lq, d]
        k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Lk, d]
        v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
        key_pos = torch.arange(seq_len, device=q.device)
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~visible, -math.inf)
        outs.append((scores.softmax(-1) @ v).transpose(0, 1))
        row += query_len
    return torch.cat(outs)


def check(step: Step, window: int | None, backend: TorchRefBackend | None = None) -> None:
    backend = backend or TorchRefBackend()
    scale = HEAD_DIM**-0.5
    meta = backend.build_metadata(step.inputs, {None, window})
    out = backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=scale, sliding_window=window)
    assert out.shape == step.q.shape and out.dtype == step.q.dtype
    expected = naive_attention(step, scale, window)
    tol = TOLERANCE[step.q.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


SCENARIOS = {
    "decodes": ([(5, 1), (17, 1), (0, 1), (40, 1)], 4),
    "prefill_no_context": ([(0, 23)], 0),
    "prefill_with_context": ([(19, 13)], 0),
    "mixed": ([(9, 1), (33, 1), (0, 21), (14, 7), (3, 1)], 2),
    # enough decodes of very different lengths to be split into several length groups
    "many_decodes": ([(c, 1) for c in (0, 3, 7, 150, 12, 90, 1, 60, 33, 200, 5, 18, 120, 2, 75, 44, 9, 160, 27, 11)]
                     + [(14, 7)], 20),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 4, 64])
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_naive(scenario: str, block_size: int, group: int, window: int | None, dtype: torch.dtype,
                       device: str) -> None:
    seqs, num_decodes = SCENARIOS[scenario]
    check(make_step(seqs, num_decodes, block_size=block_size, num_kv_heads=2, group=group, dtype=dtype,
                    device=device), window)


SHARED_BACKEND = TorchRefBackend()  # reused across examples: its workspace must not leak between steps


@settings(max_examples=60, deadline=None)
@given(
    decode_contexts=st.lists(st.integers(0, 120), max_size=24),
    chunks=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 24)), max_size=3),
    block_size=st.sampled_from([4, 16]),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    window=st.none() | st.integers(1, 48),
    seed=st.integers(0, 2**16),
)
def test_random_layouts(decode_contexts: list[int], chunks: list[tuple[int, int]], block_size: int,
                        num_kv_heads: int, group: int, window: int | None, seed: int) -> None:
    seqs = [(c, 1) for c in decode_contexts] + chunks
    if not seqs:
        return
    step = make_step(seqs, len(decode_contexts), block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                     seed=seed)
    check(step, window, SHARED_BACKEND)



def test_workspace_reuse_across_step_sizes() -> None:
    backend = TorchRefBackend()
    large = make_step([(30, 1), (40, 1), (10, 20)], 2, block_size=4, num_kv_heads=2, group=2, seed=1)
    small = make_step([(3, 1), (0, 5)], 1, block_size=4, num_kv_heads=2, group=2, seed=2)
    for step in (large, small, large):
        check(step, None, backend)


def test_forward_writes_new_kv_at_slot_mapping() -> None:
    step = make_step([(6, 1), (0, 9), (5, 4)], 1, block_size=4, num_kv_heads=2, group=2)
    before_other_layer = step.kv.layer(0).k.clone()
    backend = TorchRefBackend()
    meta = backend.build_metadata(step.inputs, {None})
    backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=1.0)
    keys, values = step.kv.layer(LAYER).gather(step.inputs.slot_mapping)
    assert torch.equal(keys, step.k)
    assert torch.equal(values, step.v)
    assert torch.equal(step.kv.layer(0).k, before_other_layer)


def test_each_layer_reuses_the_step_metadata() -> None:
    step = make_step([(7, 1), (2, 6)], 1, block_size=4, num_kv_heads=1, group=3)
    backend = TorchRefBackend()
    meta = backend.build_metadata(step.inputs, {None, 4})
    for window in (None, 4, None):
        out = backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=0.5, sliding_window=window)
        torch.testing.assert_close(out.double(), naive_attention(step, 0.5, window), atol=1e-5, rtol=1e-5)


def test_unknown_window_is_rejected() -> None:
    step = make_step([(3, 1)], 1, block_size=4, num_kv_heads=1, group=1)
    backend = TorchRefBackend()
    meta = backend.build_metadata(step.inputs, {None})
    with pytest.raises(ValueError, match="sliding_window=8"):
        backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=1.0, sliding_window=8)


def test_multi_token_sequence_among_decodes_is_rejected() -> None:
    step = make_step([(3, 2), (4, 1)], 0, block_size=4, num_kv_heads=1, group=1)
    bad = AttentionInputs(**{**step.inputs.__dict__, "num_decodes": 2})
    with pytest.raises(ValueError, match="num_decodes=2"):
        TorchRefBackend().build_metadata(bad, {None})


def test_heads_not_a_multiple_of_kv_heads_is_rejected() -> None:
    step = make_step([(3, 1)], 1, block_size=4, num_kv_heads=2, group=1)
    backend = TorchRefBackend()
    meta = backend.build_metadata(step.inputs, {None})
    with pytest.raises(ValueError, match="multiple of the cache's num_kv_heads=2"):
        backend.forward(step.q[:, :1], step.k, step.v, LAYER, step.kv, meta, scale=1.0)


def test_strided_qkv_views_as_the_model_passes_them() -> None:
    """The attention layer hands over q, k, v as column slices of one packed projection."""
    step = make_step([(5, 1), (9, 1), (4, 6)], 2, block_size=4, num_kv_heads=2, group=3)
    packed = torch.cat([step.q, step.k, step.v], dim=1)  # [T, heads + 2 * kv_heads, d]
    q, k, v = packed.split([6, 2, 2], dim=1)
    assert not q.is_contiguous() and not k.is_contiguous()
    backend = TorchRefBackend()
    meta = backend.build_metadata(step.inputs, {None})
    out = backend.forward(q, k, v, LAYER, step.kv, meta, scale=0.3)
    torch.testing.assert_close(out.double(), naive_attention(step, 0.3, None), atol=1e-5, rtol=1e-5)


def test_empty_step_is_rejected() -> None:
    step = make_step([(3, 1)], 1, block_size=4, num_kv_heads=1, group=1)
    empty = AttentionInputs(**{**step.inputs.__dict__, "query_lens_list": [], "seq_lens_list": [],
                               "slot_mapping": step.inputs.slot_mapping[:0], "num_decodes": 0})
    with pytest.raises(ValueError, match="at least one sequence"):
        TorchRefBackend().build_metadata(empty, {None})


def test_decodes_are_grouped_by_length_with_bounded_padding() -> None:
    seq_lens = [1, 200, 3, 180, 7, 40, 41, 42, 43, 44, 45, 46, 47, 48, 190, 195, 199, 185, 170, 175, 2, 4, 5, 6]
    groups = _decode_groups(seq_lens, MAX_DECODE_GROUPS_CPU)
    assert sorted(i for g in groups for i in g) == list(range(len(seq_lens)))
    assert 1 < len(groups) <= MAX_DECODE_GROUPS_CPU
    for group in groups[:-1]:
        assert len(group) >= MIN_DECODE_GROUP
    for group in groups:
        lens = [seq_lens[i] for i in group]
        if len(group) > MIN_DECODE_GROUP:  # the first MIN_DECODE_GROUP members join unconditionally
            assert max(lens) * len(lens) <= 1.25 * sum(lens)
    many = [1 + (i * 37) % 500 for i in range(256)]
    assert len(_decode_groups(many, 4)) <= 4 and _decode_groups(many, 1) == [sorted(range(256), key=many.__getitem__)]


def null_dead_blocks(step: Step, window: int) -> Step:
    """The step with every block wholly before its sequence's first visible key (its first query's window)
    named ``NULL_BLOCK``, as a sliding-window KV cache group frees them."""
    tables = step.inputs.block_tables.clone()
    block_size = step.inputs.block_size
    for seq, (seq_len, query_len) in enumerate(zip(step.inputs.seq_lens_list, step.query_lens)):
        num_dead = max(0, seq_len - query_len - window + 1) // block_size
        tables[seq, :num_dead] = NULL_BLOCK
    return replace(step, inputs=replace(step.inputs, block_tables=tables))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_blocks_before_every_window_may_be_null(block_size: int) -> None:
    """Decodes of different lengths padded to one another (padding reads position 0 only of a sequence shorter
    than its window, which has no null entry) and chunks."""
    step = make_step([(3, 1), (50, 1), (29, 1), (70, 1), (40, 9), (0, 12), (33, 20)], 4, block_size=block_size,
                     num_kv_heads=2, group=2)
    check(null_dead_blocks(step, 6), 6)
