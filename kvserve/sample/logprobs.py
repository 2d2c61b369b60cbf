"""Log probabilities of chosen tokens, their ranks and the top-k alternatives, as host-side TokenLogprobs."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvserve.device_copy import HostCopy
from kvserve.outputs import TokenLogprobs


def logprob_values(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """What logprob entries hold of fp32 ``logits`` [R, V] under ``mode`` (``config.LOGPROBS_MODES``; raw or
    processed is the caller's choice of logits): log probabilities, or the logits themselves (not copied)."""
    return torch.log_softmax(logits, dim=-1) if mode.endswith("_logprobs") else logits


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of ``logprobs`` [R, V]: the logprob and rank (1 + the number of strictly more likely tokens) of
    ``token_ids[r]``, followed by the row's ``num_top[r]`` most likely tokens with ranks 1..num_top[r].
    One top-k over the batch (k = the largest ``num_top``) and one host copy of each result tensor."""
    return launch_gather_logprobs(logprobs, token_ids, num_top)()


def launch_gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                           num_top: Sequence[int]) -> Callable[[], list[TokenLogprobs]]:
    """``gather_logprobs`` in two halves: the device's work and the copies of its results to the host queued
    now; the call returned waits for those copies alone (``HostCopy``: not for a step queued after them) and
    builds the entries."""
    if len(num_top) != logprobs.shape[0]:
        raise ValueError(f"num_top has {len(num_top)} entries for {logprobs.shape[0]} rows")
    chosen = logprobs.gather(1, token_ids[:, None].long())
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(max(num_top, default=0), logprobs.shape[1])
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    copies = [HostCopy(t) for t in (chosen[:, 0], ranks, top_logprobs, top_ids, token_ids)]

    def entries() -> list[TokenLogprobs]:
        chosen_list, ranks_list, top_lp_list, top_id_list, token_list = (c.result().tolist() for c in copies)
        return [
            TokenLogprobs(
                token_ids=[token_list[r], *top_id_list[r][:n]],
                logprobs=[chosen_list[r], *top_lp_list[r][:n]],
                ranks=[ranks_list[r], *range(1, min(n, k) + 1)],
            )
            for r, n in enumerate(num_top)
        ]

    return entries
