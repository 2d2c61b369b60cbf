"""Both backends on quantized caches (int8, fp8, int4): the C kernels dequantize as they read, the reference
dequantizes what it gathers, and both agree with the float64 naive attention over the dequantized histories."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.attention.test_cpu_paged as paged_tests
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv.quant import ENCODINGS
from tests.attention.test_torch_ref import LAYER, SCENARIOS, Step, naive_attention

TOLERANCE = 1e-5
ENCODING_NAMES = list(ENCODINGS)


def make_step(seqs: list[tuple[int, int]], num_decodes: int, encoding: str, **kwargs) -> Step:
    return paged_tests.make_step(seqs, num_decodes, encoding=ENCODINGS[encoding], **kwargs)


def check(step: Step, window: int | None, backend: CpuPagedBackend | None = None) -> None:
    """The kernels equal the reference backend, and both the float64 naive attention over what the cache holds
    once the step's keys are written (its histories read back, dequantized)."""
    scale = step.q.shape[-1] ** -0.5
    outs = []
    for b in (backend or CpuPagedBackend(), TorchRefBackend()):  # both quantize the same new K/V the same way
        meta = b.build_metadata(step.inputs, {None, window})
        outs.append(b.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=scale, sliding_window=window))
    paged, reference = outs
    torch.testing.assert_close(paged, reference, atol=TOLERANCE, rtol=TOLERANCE)
    stored = replace(step, histories=[step.kv.layer(LAYER).gather(seq_slots(step, seq))
                                      for seq in range(len(step.histories))])
    torch.testing.assert_close(paged.double(), naive_attention(stored, scale, window), atol=TOLERANCE, rtol=TOLERANCE)


def seq_slots(step: Step, seq: int) -> torch.Tensor:
    inputs = step.inputs
    positions = torch.arange(inputs.seq_lens_list[seq])
    blocks = inputs.block_tables[seq].long()[positions // inputs.block_size]
    return blocks * inputs.block_size + positions % inputs.block_size


@pytest.mark.parametrize("encoding", ENCODING_NAMES)
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_reference(scenario: str, block_size: int, group: int, window: int | None, encoding: str) -> None:
    seqs, num_decodes = SCENARIOS[scenario]
    step = make_step(seqs, num_decodes, encoding, head_dim=8, block_size=block_size, num_kv_heads=2, group=group)
    check(step, window)


@pytest.mark.parametrize("encoding", ENCODING_NAMES)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 48, 20])  # 48: int4's halves are not whole 16-float vectors
@pytest.mark.parametrize("window", [None, 100])
def test_compiled_head_dims_on_long_contexts(encoding: str, head_dim: int, window: int | None,
                                             isa_backend: CpuPagedBackend) -> None:
    contexts = [0, 1, 31, 32, 33, 95, 300, 447, 64, 200, 15, 129]
    step = make_step([(c, 1) for c in contexts] + [(40, 24)], len(contexts), encoding, head_dim=head_dim,
                     block_size=16, num_kv_heads=3, group=3, seed=head_dim)
    check(step, window, isa_backend)


@pytest.mark.parametrize("encoding", ENCODING_NAMES)
@pytest.mark.parametrize("head_dim", [64, 48, 8])  # int8 read in place (64, 48) or dequantized (8)
@pytest.mark.parametrize("window", [None, 40])
def test_decodes_sharing_a_prefix(encoding: str, head_dim: int, window: int | None,
                                  isa_backend: CpuPagedBackend) -> None:
    """The cascade: shared blocks read once for a group."""
    contexts = [70, 100, 65, 300, 90, 200, 33, 64, 47] + [80 + 7 * i for i in range(24)]
    step = make_step([(c, 1) for c in contexts] + [(40, 9)], len(contexts), encoding, head_dim=head_dim,
                     block_size=16, num_kv_heads=3, group=3, seed=7)
    big_group = list(range(9, 33))
    step = paged_tests.share_leading_blocks(step, [([0, 1, 3, 5], 4), ([2, 4], 4), ([3, 5], 12), (big_group, 5)])
    check(step, window, isa_backend)


@pytest.mark.parametrize("encoding", ENCODING_NAMES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("head_dim", [64, 256, 20])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_chunks_on_odd_shapes(encoding: str, group: int, head_dim: int, window: int | None) -> None:
    seqs = [(c, n) for c in paged_tests.CONTEXT_LENS for n in paged_tests.CHUNK_LENS]
    step = make_step(seqs, 0, encoding, head_dim=head_dim, block_size=16, num_kv_heads=2, group=group,
                     seed=head_dim + group)
    check(step, window)


SHARED_BACKEND = CpuPagedBackend()


@settings(max_examples=40, deadline=None)
@given(
    encoding=st.sampled_from(ENCODING_NAMES),
    decode_contexts=st.lists(st.integers(0, 120), max_size=16),
    chunks=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 24)), max_size=2),
    block_size=st.sampled_from([1, 4, 16]),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([2, 8, 34, 64]),
    window=st.none() | st.integers(1, 48),
    seed=st.integers(0, 2**16),
)
def test_random_layouts(encoding: str, decode_contexts: list[int], chunks: list[tuple[int, int]], block_size: int,
                        num_kv_heads: int, group: int, head_dim: int, window: int | None, seed: int) -> None:
    seqs = [(c, 1) for c in decode_contexts] + chunks
    if not seqs:
        return
    step = make_step(seqs, len(decode_contexts), encoding, head_dim=head_dim, block_size=block_size,
                     num_kv_heads=num_kv_heads, group=group, seed=seed)
    check(step, window, SHARED_BACKEND)




def decodes_alone(step: Step, seq: int) -> Step:
    """Decode ``seq`` of a decode-only step as a step of its own, over the same cache and block table."""
    inputs = step.inputs
    num_blocks = -(-inputs.seq_lens_list[seq] // inputs.block_size)
    alone = replace(
        inputs, num_decodes=1, query_start_loc=inputs.query_start_loc[:2],
        seq_lens=inputs.seq_lens[seq : seq + 1].clone(),
        block_tables=inputs.block_tables[seq : seq + 1, :num_blocks].clone(),
        slot_mapping=inputs.slot_mapping[seq : seq + 1].clone(),
        query_lens_list=[1], seq_lens_list=[inputs.seq_lens_list[seq]])
    rows = slice(seq, seq + 1)
    return replace(step, inputs=alone, q=step.q[rows], k=step.k[rows], v=step.v[rows],
                   histories=[step.histories[seq]], query_lens=[1])


def decode_attention(step: Step, backend: CpuPagedBackend, window: int | None) -> torch.Tensor:
    meta = backend.build_metadata(step.inputs, {None, window})
    scale = step.q.shape[-1] ** -0.5
    return backend.forward(step.q, step.k, step.v, LAYER, step.kv, meta, scale=scale, sliding_window=window)


@pytest.mark.parametrize("encoding", [None, *ENCODING_NAMES])
@pytest.mark.parametrize("head_dim", [64, 16, 8])
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 200])
def test_a_decode_sharing_its_prefix_gets_the_bits_it_gets_alone(encoding: str | None, head_dim: int, group: int,
                                                                 window: int | None, num_threads: int,
                                                                 isa_backend: CpuPagedBackend) -> None:
    """Cascade attention is batch-invariant: a decode's output is bit for bit what it is alone, whatever shares
    its step (groups whose common blocks are not whole tiles, a member sharing less than the rest, groups cut
    into several work items, any thread count). With a quantized cache a last-bit difference here becomes
    another code in the next layer's K/V, and a request's tokens then depended on its neighbours. (Query heads
    per KV head 1 and 2 as well as 3: a sharing group's query heads are taken 3 at a time, so with 1 or 2 the
    group's copy of the sums runs in other loop shapes than a decode's alone, which gcc tuned for AMD Zen 1-3
    fused differently until the kernels' flags said otherwise: kvserve/native.py.)"""
    contexts = [70, 100, 65, 300, 90, 200, 33, 64, 47] + [80 + 7 * i for i in range(24)]
    kind = {} if encoding is None else {"encoding": ENCODINGS[encoding]}
    step = paged_tests.make_step([(c, 1) for c in contexts], len(contexts), head_dim=head_dim, block_size=16,
                                 num_kv_heads=2, group=group, seed=11, **kind)
    step = paged_tests.share_leading_blocks(step, [([0, 1, 3, 5], 5), ([2, 4], 4), ([3, 5], 12),
                                                   (list(range(9, 33)), 5)])
    batched = decode_attention(step, isa_backend, window)
    for seq in range(len(contexts)):
        alone = decode_attention(decodes_alone(step, seq), isa_backend, window)
        assert torch.equal(batched[seq : seq + 1], alone), f"decode {seq} differs from its output alone"
