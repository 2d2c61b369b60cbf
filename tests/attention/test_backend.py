"""``attention.backend.shared_prefixes``, which the runner calls every step for cascade attention, against its
definition written out group by group: steps of many groups (samples of a few prompts), of none, of short and
partial members."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.attention.backend import shared_prefixes

BLOCK_SIZE = 4


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
