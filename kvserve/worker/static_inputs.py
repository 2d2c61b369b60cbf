"""StaticStepInputs: a decode step's inputs in tensors whose memory never moves, which step graphs read.

A graph (CPU or CUDA, ``worker/cpu_graph.py``, ``worker/cuda_graph.py``) runs on the addresses it saw when it
was made, so each step's inputs are copied into the same tensors before a replay. One set serves graphs of
every size up to its capacity: a graph of n tokens reads the first n rows (``prefix``), and a step of fewer
tokens than its graph fills the rest with padding rows::

    rows:          | step's tokens 0 .. n-1 |  padding n .. size-1  |  (rows past size: unread)
    token, pos:    |  the step's            |  0, 0                 |
    seq_len:       |  the step's            |  0: attends to no key |
    slot (K/V):    |  the step's            |  padding_slot: a slot no block table names
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionInputs


@dataclass(frozen=True)
class StaticStepInputs:
    """Token ids, positions, sequence lengths and, per KV cache group, slots, block tables (as wide as the
    longest context) and the keys they all share of up to ``len(input_ids)`` one-token sequences."""

    input_ids: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N]
    seq_lens: torch.Tensor  # int32 [N]
    slot_mapping: tuple[torch.Tensor, ...]  # per group, int64 [N]
    block_tables: tuple[torch.Tensor, ...]  # per group, int32 [N, max_blocks]
    query_start_loc: torch.Tensor  # int32 [N + 1]: 0, 1, ..., N
    shared_prefix_lens: tuple[torch.Tensor, ...]  # per group, int32 [N]: the keys each shares with its group
    sharing_order: tuple[torch.Tensor, ...]  # per group, int32 [N]: the rows, each sharing group's together
    block_size: int
    padding_slot: int

    @classmethod
    def allocate(cls, capacity: int, max_blocks: int, block_size: int, device: torch.device, num_groups: int,
                 padding_slot: int = 0) -> StaticStepInputs:
        """Inputs for up to ``capacity`` tokens, every row padding until loaded."""
        def full(*shape: int, dtype: torch.dtype, value: int = 0) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(
            input_ids=full(capacity, dtype=torch.int64), positions=full(capacity, dtype=torch.int64),
            seq_lens=full(capacity, dtype=torch.int32),
            slot_mapping=tuple(full(capacity, dtype=torch.int64, value=padding_slot) for _ in range(num_groups)),
            block_tables=tuple(full(capacity, max_blocks, dtype=torch.int32) for _ in range(num_groups)),
            query_start_loc=torch.arange(capacity + 1, dtype=torch.int32, device=device),
            shared_prefix_lens=tuple(full(capacity, dtype=torch.int32) for _ in range(num_groups)),
            sharing_order=tuple(torch.arange(capacity, dtype=torch.int32, device=device) for _ in range(num_groups)),
            block_size=block_size, padding_slot=padding_slot,
        )

    @property
    def capacity(self) -> int:
        return len(self.input_ids)

    def prefix(self, size: int) -> StaticStepInputs:
        """The first ``size`` rows, sharing this set's memory."""
        return dataclasses.replace(
            self, input_ids=self.input_ids[:size], positions=self.positions[:size], seq_lens=self.seq_lens[:size],
            slot_mapping=tuple(s[:size] for s in self.slot_mapping),
            block_tables=tuple(t[:size] for t in self.block_tables), query_start_loc=self.query_start_loc[: size + 1],
            shared_prefix_lens=tuple(s[:size] for s in self.shared_prefix_lens),
            sharing_order=tuple(o[:size] for o in self.sharing_order),
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs) -> None:
        """Copy a decode step's inputs into the first rows and make every later row padding."""
        n = attn.num_tokens
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(attn.seq_lens)
        for group, inputs in enumerate((attn, *attn.groups)):
            self.slot_mapping[group][:n].copy_(inputs.slot_mapping)
            self.block_tables[group][:n, : inputs.block_tables.shape[1]].copy_(inputs.block_tables)
            if inputs.shared_prefix_lens is None or inputs.sharing_order is None:
                self.shared_prefix_lens[group][:n].zero_()
                self.sharing_order[group][:n].copy_(self.query_start_loc[:n])  # a permutation still
            else:
                self.shared_prefix_lens[group][:n].copy_(inputs.shared_prefix_lens)
                self.sharing_order[group][:n].copy_(inputs.sharing_order)
        if n < self.capacity:
            for padded in (self.input_ids[n:], self.positions[n:], self.seq_lens[n:]):
                padded.zero_()
            for slots in self.slot_mapping:
                slots[n:].fill_(self.padding_slot)
            for group in range(len(self.sharing_order)):  # padding rows share nothing, each in its own place
                self.shared_prefix_lens[group][n:].zero_()
                self.sharing_order[group][n:].copy_(self.query_start_loc[n : self.capacity])

    def attention_inputs(self, seq_lens_list: list[int]) -> AttentionInputs:
        """The backends' view of these rows as one decode each; ``seq_lens_list`` is what metadata built once
        for every later step may assume of their lengths (a graph's: the longest it serves)."""
        num_tokens = self.capacity
        group_inputs = [
            AttentionInputs(
                num_decodes=num_tokens, query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                block_tables=block_tables, slot_mapping=slot_mapping, query_lens_list=[1] * num_tokens,
                seq_lens_list=seq_lens_list, block_size=self.block_size, shared_prefix_lens=shared,
                sharing_order=order, max_shared_prefix_len=max(seq_lens_list, default=0),
            )
            for block_tables, slot_mapping, shared, order in zip(self.block_tables, self.slot_mapping,
                                                                 self.shared_prefix_lens, self.sharing_order)
        ]
        return dataclasses.replace(group_inputs[0], groups=tuple(group_inputs[1:]))
