"""``AttentionBackend.forward``'s checks, the same for every backend; ``attention.backend.shared_prefixes``, which
the runner calls every step for cascade attention, against its definition written out group by group: steps of
many groups (samples of a few prompts), of none, of short and partial members."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.attention.backend import AttentionBackend, shared_prefixes
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from tests.attention.test_torch_ref import LAYER, make_step

BLOCK_SIZE = 4


def triton_backend() -> AttentionBackend:
    """The Triton backend where its kernels run on this step's CPU tensors: under the interpreter."""
    triton_paged = pytest.importorskip("kvserve.attention.triton_paged")
    if not triton_paged.is_interpreted():
        pytest.skip("the steps here are on CPU; test_triton_paged.py checks the compiled backend")
    return triton_paged.TritonPagedBackend()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch_ref": TorchRefBackend, "cpu_paged": CpuPagedBackend, "triton": triton_backend,
}


@pytest.mark.parametrize("name", BACKENDS)
def test_forward_refuses_what_does_not_fit_the_step_alike_in_every_backend(name: str) -> None:
    """The reference is as strict as the backends it judges, and a refused call writes nothing."""
    backend = BACKENDS[name]()
    step = make_step([(3, 1), (0, 4)], 1, block_size=4, num_kv_heads=2, group=2)
    meta = backend.build_metadata(step.inputs, {None})
    other_meta = (CpuPagedBackend() if name == "torch_ref" else TorchRefBackend()).build_metadata(step.inputs, {None})
    rope = (torch.ones(step.q.shape[0], 1, step.q.shape[2] // 2), torch.zeros(step.q.shape[0], 1, step.q.shape[2] // 2))
    cache_before = [t.clone() for t in step.kv.layer(LAYER).tensors()]
    bad_calls = [
        (ValueError, "multiple of the cache's num_kv_heads=2", dict(q=step.q[:, :3])),
        (ValueError, "num_kv_heads=2", dict(k=step.k[:, :1], v=step.v[:, :1])),  # q's 4 heads would fit 1
        (ValueError, "head_dim=8", dict(q=step.q[..., :4])),
        (ValueError, "a step of 5 tokens", dict(q=step.q[:4], k=step.k[:4], v=step.v[:4])),
        (ValueError, "sliding_window=8", dict(sliding_window=8)),
        (TypeError, f"{type(backend).__name__} needs {type(meta).__name__}", dict(meta=other_meta)),
    ]
    if not backend.takes_rope(step.kv, LAYER):
        bad_calls.append((ValueError, f"{type(backend).__name__} does not rotate", dict(rope=rope)))
    for error, words, bad in bad_calls:
        call = dict(q=step.q, k=step.k, v=step.v, layer=LAYER, kv=step.kv, meta=meta, scale=1.0) | bad
        with pytest.raises(error, match=words):
            backend.forward(**call)
    assert all(torch.equal(t, before) for t, before in zip(step.kv.layer(LAYER).tensors(), cache_before))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("window", [0, -4])
def test_metadata_refuses_a_window_of_no_tokens(name: str, window: int) -> None:
    step = make_step([(3, 1), (0, 4)], 1, block_size=4, num_kv_heads=1, group=1)
    with pytest.raises(ValueError, match="sliding windows must be positive numbers of tokens"):
        BACKENDS[name]().build_metadata(step.inputs, {None, window})


def definition(tables: np.ndarray, seq_lens: np.ndarray) -> list[int]:
    """Each decode's keys shared with the decodes whose tables start with its first block: their longest common
    run of leading blocks complete before every member's own key; 0 alone."""
    shared = []
    for row, length in zip(tables, seq_lens):
        members = [i for i in range(len(tables)) if tables[i, 0] == row[0]]
        if len(members) < 2:
            shared.append(0)
            continue
        limit = min((int(seq_lens[i]) - 1) // BLOCK_SIZE for i in members)
        run = 0
        while run < limit and all(tables[i, run] == tables[members[0], run] for i in members):
            run += 1
        shared.append(run * BLOCK_SIZE)
    return shared


@settings(max_examples=300, deadline=None)
@given(data=st.data(), num_decodes=st.integers(1, 24), width=st.integers(1, 6))
def test_shared_prefixes_follow_their_definition(data: st.DataObject, num_decodes: int, width: int) -> None:
    """Tables drawn from a few prompts' block runs, each decode's own blocks after a random point: many groups,
    members that diverge at different blocks, lengths that end inside their first blocks."""
    prompts = data.draw(st.lists(st.lists(st.integers(0, 5), min_size=width, max_size=width), min_size=1,
                                 max_size=4))
    tables, seq_lens = [], []
    for i in range(num_decodes):
        prompt = prompts[data.draw(st.integers(0, len(prompts) - 1))]
        own = data.draw(st.integers(0, width))
        tables.append(prompt[:own] + [100 + i * width + j for j in range(width - own)])
        seq_lens.append(data.draw(st.integers(1, width * BLOCK_SIZE)))
    tables_np, lens_np = np.array(tables, dtype=np.int32), np.array(seq_lens, dtype=np.int32)
    shared, order = shared_prefixes(tables_np, lens_np, BLOCK_SIZE)
    assert shared.tolist() == definition(tables_np, lens_np)
    assert sorted(order.tolist()) == list(range(num_decodes))
    firsts = tables_np[order, 0].tolist()
    assert firsts == sorted(firsts)  # each group's members consecutive
