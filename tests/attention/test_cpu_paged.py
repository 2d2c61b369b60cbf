"""CpuPagedBackend against TorchRefBackend and the float64 naive attention; its kernel build; the selector."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.attention.test_torch_ref as ref_tests
from kvserve.attention import selector
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.selector import select_backend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.native import KernelBuildError
from tests.attention.test_torch_ref import LAYER, SCENARIOS, TOLERANCE, Step, naive_attention

CPU = torch.device("cpu")


def make_step(seqs: list[tuple[int, int]], num_decodes: int, *, head_dim: int, **kwargs) -> Step:
    """``test_torch_ref.make_step`` at a chosen head_dim: the kernel has a compiled copy per common head_dim
    (64, 128, 256) and a generic one for the rest (the reference tests' 8)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ref_tests, "HEAD_DIM", head_dim)
        return ref_tests.make_step(seqs, num_decodes, **kwargs)


def check(step: Step, window: int | None, backend: CpuPagedBackend | None = None) -> None:
    """The new backend equals the reference backend, and both equal the float64 naive attention."""
    scale = step.q.shape[-1] ** -0.5
    outs = []
    for b in (backend or CpuPagedBackend(), TorchRefBackend()):
        kv = step.kv  # each backend writes the same new K/V at the same slots, so the cache can be shared
        meta = b.build_metadata(step.inputs, {None, window})
        outs.append(b.forward(step.q, step.k, step.v, LAYER, kv, meta, scale=scale, sliding_window=window))
    paged, reference = outs
    assert paged.shape == step.q.shape and paged.dtype == torch.float32
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(paged, reference, atol=tol, rtol=tol)
    torch.testing.assert_close(paged.double(), naive_attention(step, scale, window), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 4, 64])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_reference(scenario: str, block_size: int, group: int, window: int | None) -> None:
    seqs, num_decodes = SCENARIOS[scenario]
    check(make_step(seqs, num_decodes, head_dim=8, block_size=block_size, num_kv_heads=2, group=group), window)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 48])
@pytest.mark.parametrize("window", [None, 100])
def test_compiled_head_dims_on_long_contexts(head_dim: int, window: int | None, num_threads: int,
                                             isa_backend: CpuPagedBackend) -> None:
    """SmolLM2's shape (3 KV heads, 3 query heads each) at contexts of several tiles."""
    contexts = [0, 1, 31, 32, 33, 95, 300, 447, 64, 200, 15, 129]
    step = make_step([(c, 1) for c in contexts] + [(40, 24)], len(contexts), head_dim=head_dim, block_size=16,
                     num_kv_heads=3, group=3, seed=head_dim)
    check(step, window, isa_backend)


SHARED_BACKEND = CpuPagedBackend()  # reused across examples, as the runner reuses it across steps


@settings(max_examples=60, deadline=None)
@given(
    decode_contexts=st.lists(st.integers(0, 120), max_size=24),
    chunks=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 24)), max_size=3),
    block_size=st.sampled_from([1, 4, 16]),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([8, 64]),
    window=st.none() | st.integers(1, 48),
    seed=st.integers(0, 2**16),
)
def test_random_layouts(decode_contexts: list[int], chunks: list[tuple[int, int]], block_size: int,
                        num_kv_heads: int, group: int, head_dim: int, window: int | None, seed: int) -> None:
    seqs = [(c, 1) for c in decode_contexts] + chunks
    if not seqs:
        return
    step = make_step(seqs, len(decode_contexts), head_dim=head_dim, block_size=block_size,
                     num_kv_heads=num_kv_heads, group=group, seed=seed)
    check(step, window, SHARED_BACKEND)


def share_leading_blocks(step: Step, groups: list[tuple[list[int], int]]) -> Step:
    """The step with each group's decodes reading their first ``num_blocks`` blocks from the group's first
    member's blocks, as prefix-cache hits on one prompt do; the histories follow, so the naive attention agrees."""
    tables, histories = step.inputs.block_tables.clone(), list(step.histories)
    for members, num_blocks in groups:
        leader, shared = members[0], num_blocks * step.inputs.block_size
        for seq in members[1:]:
            tables[seq, :num_blocks] = tables[leader, :num_blocks]
            histories[seq] = tuple(torch.cat([lead[:shared], own[shared:]])
                                   for lead, own in zip(histories[leader], histories[seq]))
    return replace(step, inputs=replace(step.inputs, block_tables=tables), histories=histories)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 48, 8])  # 48: whole vectors, not a power of 2; 8: not whole
@pytest.mark.parametrize("window", [None, 40])
def test_decodes_sharing_a_prefix_read_it_once_and_agree(head_dim: int, window: int | None, num_threads: int,
                                                         isa_backend: CpuPagedBackend) -> None:
    """Two groups on shared prompts (one with more members than one work item takes), members of different
    lengths, one member sharing less than the rest, and decodes that share nothing, mixed with a chunk."""
    contexts = [70, 100, 65, 300, 90, 200, 33, 64, 47] + [80 + 7 * i for i in range(24)]
    step = make_step([(c, 1) for c in contexts] + [(40, 9)], len(contexts), head_dim=head_dim, block_size=16,
                     num_kv_heads=3, group=3, seed=7)
    big_group = list(range(9, 33))
    step = share_leading_blocks(step, [([0, 1, 3, 5], 4), ([2, 4], 4), ([3, 5], 12), (big_group, 5),
                                       ([7, 8], 2)])
    check(step, window, isa_backend)


@pytest.mark.parametrize(("num_decodes", "group"), [(512, 3), (3, 80)])
def test_groups_too_large_for_one_work_item(num_decodes: int, group: int) -> None:
    """512 sharers of one prompt with 3 query heads each (a prefill chunk's rows, say) are cut into chunks of
    at most 64 query heads; 80 query heads on one KV head make a chunk of one member of more than 64."""
    contexts = [40 + i % 17 for i in range(num_decodes)]
    step = make_step([(c, 1) for c in contexts], num_decodes, head_dim=64, block_size=4, num_kv_heads=1,
                     group=group, seed=num_decodes)
    check(share_leading_blocks(step, [(list(range(num_decodes)), 8)]), None)  # a whole tile: 32 keys


@settings(max_examples=40, deadline=None)
@given(
    contexts=st.lists(st.integers(1, 120), min_size=2, max_size=20),
    data=st.data(),
    block_size=st.sampled_from([1, 4, 16]),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([8, 48, 64, 128]),
    window=st.none() | st.integers(1, 64),
    seed=st.integers(0, 2**16),
)
def test_random_shared_prefixes(contexts: list[int], data: st.DataObject, block_size: int, group: int,
                                head_dim: int, window: int | None, seed: int) -> None:
    step = make_step([(c, 1) for c in contexts], len(contexts), head_dim=head_dim, block_size=block_size,
                     num_kv_heads=2, group=group, seed=seed)
    members = data.draw(st.lists(st.integers(0, len(contexts) - 1), min_size=2, max_size=len(contexts), unique=True))
    shortest = min(contexts[m] for m in members) // block_size  # blocks wholly before every member's new token
    if shortest:
        step = share_leading_blocks(step, [(sorted(members), data.draw(st.integers(1, shortest)))])
    check(step, window, SHARED_BACKEND)


CHUNK_LENS, CONTEXT_LENS = (1, 3, 17, 130), (0, 5, 33, 700)


@pytest.mark.parametrize("window", [None, 7, 64])
@pytest.mark.parametrize("head_dim", [64, 256, 80, 20])  # 80: no compiled copy; 20: not whole vectors
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_chunks_on_odd_shapes(block_size: int, group: int, head_dim: int, window: int | None) -> None:
    """Every chunk length on every cached context, in one step: query tiles cut short, diagonal tiles, windows
    that start inside a tile and inside a block, chunks shorter and longer than the window."""
    seqs = [(c, n) for c in CONTEXT_LENS for n in CHUNK_LENS]
    step = make_step(seqs, 0, head_dim=head_dim, block_size=block_size, num_kv_heads=2, group=group,
                     seed=head_dim + group)
    check(step, window)


@pytest.mark.parametrize("window", [None, 40])
def test_decodes_and_chunks_in_one_step(window: int | None, num_threads: int) -> None:
    """Both kernels in one forward, a chunk long enough for many work items beside chunks of one token."""
    contexts = [0, 17, 300, 64, 129, 5]
    step = make_step([(c, 1) for c in contexts] + [(0, 200), (70, 1), (33, 45)], len(contexts), head_dim=64,
                     block_size=16, num_kv_heads=3, group=3, seed=3)
    check(step, window)


def test_forward_writes_new_kv_of_decodes_and_chunks_at_slot_mapping() -> None:
    step = make_step([(6, 1), (9, 1), (0, 9), (5, 4)], 2, head_dim=64, block_size=4, num_kv_heads=2, group=2)
    other_layer = step.kv.layer(0).k.clone()
    backend = CpuPagedBackend()
    backend.forward(step.q, step.k, step.v, LAYER, step.kv, backend.build_metadata(step.inputs, {None}), scale=1.0)
    keys, values = step.kv.layer(LAYER).gather(step.inputs.slot_mapping)
    assert torch.equal(keys, step.k)
    assert torch.equal(values, step.v)
    assert torch.equal(step.kv.layer(0).k, other_layer)


def test_strided_qkv_views_as_the_model_passes_them() -> None:
    """The attention layer hands over q, k, v as column slices of one packed projection."""
    step = make_step([(5, 1), (40, 1), (4, 6)], 2, head_dim=64, block_size=16, num_kv_heads=2, group=3)
    q, k, v = torch.cat([step.q, step.k, step.v], dim=1).split([6, 2, 2], dim=1)
    assert not q.is_contiguous() and not k.is_contiguous()
    backend = CpuPagedBackend()
    out = backend.forward(q, k, v, LAYER, step.kv, backend.build_metadata(step.inputs, {None}), scale=0.3)
    torch.testing.assert_close(out.double(), naive_attention(step, 0.3, None), atol=1e-5, rtol=1e-5)


def test_each_layer_reuses_the_step_metadata() -> None:
    step = make_step([(7, 1), (30, 1), (2, 6)], 2, head_dim=64, block_size=4, num_kv_heads=1, group=3)
    backend = CpuPagedBackend()
    meta = backend.build_metadata(step.inputs, {None, 4})
    for window in (None, 4, None):
        out = backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=0.5, sliding_window=window)
        torch.testing.assert_close(out.double(), naive_attention(step, 0.5, window), atol=1e-5, rtol=1e-5)


def test_bad_calls_are_rejected_with_what_is_wrong() -> None:
    step = make_step([(3, 1), (0, 4)], 1, head_dim=8, block_size=4, num_kv_heads=2, group=1)
    backend = CpuPagedBackend()
    meta = backend.build_metadata(step.inputs, {None})
    with pytest.raises(ValueError, match="multiple of the cache's num_kv_heads"):
        backend.forward(step.q[:, :1], step.k, step.v, LAYER, step.kv, meta, scale=1.0)
    with pytest.raises(ValueError, match="head_dim=8"):
        backend.forward(step.q[..., :4], step.k, step.v, LAYER, step.kv, meta, scale=1.0)
    with pytest.raises(TypeError, match="fp32"):
        backend.forward(step.q.double(), step.k, step.v, LAYER, step.kv, meta, scale=1.0)
    with pytest.raises(TypeError, match="CpuPagedMetadata"):
        backend.forward(step.q, step.k, step.v, LAYER, step.kv, TorchRefBackend().build_metadata(step.inputs, {None}),
                        scale=1.0)
    with pytest.raises(ValueError, match="sliding_window=8"):  # the prefill chunk's window was not planned
        backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=1.0, sliding_window=8)


def test_corrupt_block_tables_raise_instead_of_reading_outside_the_cache() -> None:
    step = make_step([(20, 1), (5, 1)], 2, head_dim=64, block_size=4, num_kv_heads=1, group=2)
    backend = CpuPagedBackend()
    tables = step.inputs.block_tables.clone()
    tables[0, 2] = step.kv.num_blocks  # one past the last block
    meta = backend.build_metadata(replace(step.inputs, block_tables=tables), {None})
    with pytest.raises(ValueError, match=f"outside the cache's {step.kv.num_blocks} blocks"):
        backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=1.0)
    with pytest.raises(ValueError, match="too narrow for decodes of up to 21 tokens"):
        backend.build_metadata(replace(step.inputs, block_tables=tables[:, :5]), {None})


@pytest.mark.parametrize("bad_block", ["past_the_end", "negative"])
def test_corrupt_chunk_block_tables_raise_instead_of_reading_outside_the_cache(bad_block: str) -> None:
    step = make_step([(3, 1), (40, 9), (0, 5)], 1, head_dim=64, block_size=4, num_kv_heads=1, group=2)
    backend = CpuPagedBackend()
    tables = step.inputs.block_tables.clone()
    tables[1, 3] = step.kv.num_blocks if bad_block == "past_the_end" else -1  # a block of the cached context
    meta = backend.build_metadata(replace(step.inputs, block_tables=tables), {None})
    with pytest.raises(ValueError, match=f"a prefill's block table names a block outside the cache's "
                                         f"{step.kv.num_blocks} blocks"):
        backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=1.0)
    with pytest.raises(ValueError, match="too narrow for sequences of up to 49 tokens"):
        backend.build_metadata(replace(step.inputs, block_tables=tables[:, :10]), {None})


# --- the selector -----------------------------------------------------------------------------------------------


def test_selector_picks_the_kernel_for_fp32_cpu_and_the_reference_for_other_cpu_dtypes() -> None:
    assert isinstance(select_backend(CPU, torch.float32), CpuPagedBackend)
    assert type(select_backend(CPU, torch.bfloat16)) is TorchRefBackend


def test_selector_honours_a_forced_backend() -> None:
    assert type(select_backend(CPU, torch.float32, "torch_ref")) is TorchRefBackend
    assert isinstance(select_backend(CPU, torch.float32, "cpu_paged"), CpuPagedBackend)
    with pytest.raises(ValueError, match="runs fp32 on CPU"):
        select_backend(CPU, torch.bfloat16, "cpu_paged")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_backend(CPU, torch.float32, "flash")


def test_selector_falls_back_with_one_warning_when_the_kernel_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unbuildable() -> CpuPagedBackend:
        raise KernelBuildError("no C compiler: gcc is not on PATH (test_cpu_paged)")

    monkeypatch.setattr(selector, "CpuPagedBackend", unbuildable)
    with caplog.at_level(logging.WARNING, logger=selector.__name__):
        backends = [select_backend(CPU, torch.float32) for _ in range(3)]
    assert all(type(b) is TorchRefBackend for b in backends)
    assert [r.getMessage() for r in caplog.records] == [
        "CPU attention falls back to the slower TorchRefBackend: no C compiler: gcc is not on PATH (test_cpu_paged)"
    ]
    with pytest.raises(KernelBuildError):  # forcing the kernel does not fall back
        select_backend(CPU, torch.float32, name="cpu_paged")


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_blocks_before_every_window_may_be_null_and_a_run_of_nulls_is_no_shared_prefix(block_size: int,
                                                                                       num_threads: int) -> None:
    """Decodes past their window, whose tables all start with nulls, share no keys; two decodes within it that
    share real blocks (a whole tile of keys: the group pass takes no less) still read them once; chunks start at
    their first query's window."""
    window = 40
    step = make_step([(50, 1), (70, 1), (36, 1), (36, 1), (40, 9), (33, 20)], 4, head_dim=64, block_size=block_size,
                     num_kv_heads=2, group=2)
    step = share_leading_blocks(step, [([2, 3], 32 // block_size)])
    check(ref_tests.null_dead_blocks(step, window), window)
