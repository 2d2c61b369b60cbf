"""Log probabilities of chosen tokens, their ranks and the top-k alternatives, as host-side TokenLogprobs."""

from __future__ import annotations

from typing import Sequence

import torch

from kvserve.sched.output import TokenLogprobs


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of ``logprobs`` [R, V]: the logprob and rank (1 + the number of strictly more likely tokens) of
    ``token_ids[r]``, followed by the row's ``num_top[r]`` most likely tokens with ranks 1..num_top[r].
    One top-k over the batch (k = the largest ``num_top``) and one host copy of each result tensor."""
    if len(num_top) != logprobs.shape[0]:
        raise ValueError(f"num_top has {len(num_top)} entries for {logprobs.shape[0]} rows")
    chosen = logprobs.gather(1, token_ids[:, None].long())
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(max(num_top, default=0), logprobs.shape[1])
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    chosen_list, ranks_list = chosen[:, 0].tolist(), ranks.tolist()
    top_lp_list, top_id_list = top_logprobs.tolist(), top_ids.tolist()
    token_list = token_ids.tolist()
    return [
        TokenLogprobs(
            token_ids=[token_list[r], *top_id_list[r][:n]],
            logprobs=[chosen_list[r], *top_lp_list[r][:n]],
            ranks=[ranks_list[r], *range(1, min(n, k) + 1)],
        )
        for r, n in enumerate(num_top)
    ]
