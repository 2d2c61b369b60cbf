"""InputBatch: the flat tensors of one step, built from a SchedulerOutput.

One Python pass over the step's requests builds host arrays (numpy); everything per token is vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.backend import AttentionInputs
from kvserve.sched.output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class InputBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: AttentionInputs
    sample_rows: torch.Tensor  # int64 [S]: the token row whose hidden state each sample row reads
    sample_requests: list[ScheduledRequest]  # [S]: a request with num_samples = n appears n times
    sample_indices: list[int]  # [S]: the sample index (0 .. n-1) of each sample row
    prompt_logprob_requests: list[ScheduledRequest]
    prompt_logprob_rows: list[torch.Tensor]  # per such request: rows predicting prompt tokens
    prompt_logprob_targets: list[torch.Tensor]  # per such request: the prompt tokens they predict


def build_input_batch(sched_out: SchedulerOutput, block_size: int, device: torch.device) -> InputBatch:
    reqs = sched_out.requests
    query_lens = np.array([r.num_tokens for r in reqs], dtype=np.int64)
    start_pos = np.array([r.start_pos for r in reqs], dtype=np.int64)
    query_start = np.zeros(len(reqs) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    seq_lens = start_pos + query_lens

    seq_of_token = np.repeat(np.arange(len(reqs)), query_lens)
    positions = np.arange(int(query_start[-1])) - query_start[seq_of_token] + start_pos[seq_of_token]
    block_tables = _pad_block_tables(reqs)
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    input_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=int(query_start[-1]))

    def to_dev(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(array).to(device=device, dtype=dtype, non_blocking=True)

    attn = AttentionInputs(
        num_decodes=int(np.count_nonzero(query_lens == 1)),
        query_start_loc=to_dev(query_start, torch.int32),
        seq_lens=to_dev(seq_lens, torch.int32),
        block_tables=to_dev(block_tables, torch.int32),
        slot_mapping=to_dev(slot_mapping, torch.int64),
        query_lens_list=query_lens.tolist(),
        seq_lens_list=seq_lens.tolist(),
        block_size=block_size,
    )
    sample_requests, sample_indices, sample_rows = _sample_rows(reqs, query_start)
    lp_reqs, lp_rows, lp_targets = _prompt_logprob_rows(reqs, query_start, device)
    return InputBatch(
        input_ids=to_dev(input_ids, torch.int64),
        positions=to_dev(positions, torch.int64),
        attn=attn,
        sample_rows=to_dev(np.array(sample_rows, dtype=np.int64), torch.int64),
        sample_requests=sample_requests,
        sample_indices=sample_indices,
        prompt_logprob_requests=lp_reqs,
        prompt_logprob_rows=lp_rows,
        prompt_logprob_targets=lp_targets,
    )


def _pad_block_tables(reqs: list[ScheduledRequest]) -> np.ndarray:
    width = max((len(r.block_ids) for r in reqs), default=0)
    table = np.zeros((len(reqs), max(width, 1)), dtype=np.int64)
    for i, r in enumerate(reqs):
        table[i, : len(r.block_ids)] = r.block_ids
    return table


def _sample_rows(
    reqs: list[ScheduledRequest], query_start: np.ndarray
) -> tuple[list[ScheduledRequest], list[int], list[int]]:
    """The last token of each sampling request is its sample row, repeated once per sample when it forks."""
    sample_requests, sample_indices, rows = [], [], []
    for i, r in enumerate(reqs):
        if not r.sample:
            continue
        for s in range(r.num_samples):
            sample_requests.append(r)
            sample_indices.append(r.sample_index if r.num_samples == 1 else s)
            rows.append(int(query_start[i + 1]) - 1)
    return sample_requests, sample_indices, rows


def _prompt_logprob_rows(
    reqs: list[ScheduledRequest], query_start: np.ndarray, device: torch.device
) -> tuple[list[ScheduledRequest], list[torch.Tensor], list[torch.Tensor]]:
    """Rows of a chunk whose next token is still a prompt token: position p predicts prompt[p + 1].

        chunk positions:   s ......................... s+L-1
        predict prompt:    s+1 ........ P-1               (P = num prompt tokens; p + 1 < P)
    """
    lp_reqs, lp_rows, lp_targets = [], [], []
    for i, r in enumerate(reqs):
        if not r.prompt_logprobs:
            continue
        last = min(r.start_pos + r.num_tokens, len(r.prompt_token_ids) - 1)  # exclusive end of predicting positions
        if last <= r.start_pos:
            continue
        first_row = int(query_start[i])
        lp_reqs.append(r)
        lp_rows.append(torch.arange(first_row, first_row + last - r.start_pos, device=device))
        targets = r.prompt_token_ids[r.start_pos + 1 : last + 1]
        lp_targets.append(torch.tensor(targets, dtype=torch.int64, device=device))
    return lp_reqs, lp_rows, lp_targets
