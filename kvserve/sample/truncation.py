"""Truncation of temperature-scaled logits [R, V], in place, inside the sampler's draw: min-p, then top-k and
top-p (one shared sort), in vLLM's order. Masked tokens become -inf; greedy rows never come here."""

from __future__ import annotations

import numpy as np
import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Keep each row's logits at least as large as its ``top_k``-th largest (0: all; every token tied with the
    k-th stays, as in vLLM), then the smallest set of those whose probability reaches ``top_p`` (1: all); the
    rest become -inf. One sort serves both. On CPU only the values are sorted, by numpy
    (``_truncate_by_threshold``): torch's CPU sort of a 49,152-token row cost 2-36 ms, numpy's 0.1. There top-p
    also keeps every token tied with the last one it keeps, where the sort (CUDA's) keeps the tied tokens it
    happened to put first: the two differ only on a row with such a tie."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        _truncate_by_threshold(logits, top_k, top_p)
    else:
        _truncate_by_sort(logits, top_k, top_p)


def _truncate_by_sort(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        sorted_logits.masked_fill_(sorted_logits < _kth(sorted_logits, _kept_counts(top_k, vocab_size)), -float("inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        sorted_logits.masked_fill_(_beyond_p(probs, top_p), -float("inf"))
    logits.scatter_(1, order, sorted_logits)


def _truncate_by_threshold(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """``_truncate_by_sort``'s kept set, read as each row's cut-off value off its values sorted largest first
    (no indices, no scatter back), then every logit below the cut masked. The one difference: a token tied with
    the last one top-p keeps stays too, where the sort keeps the ties it happened to put first."""
    vocab_size = logits.shape[1]
    sorted_logits = torch.from_numpy(np.sort(logits.numpy(), axis=-1)).flip(-1)
    cut = torch.full((len(logits), 1), -float("inf"))
    if top_k is not None:
        cut = _kth(sorted_logits, _kept_counts(top_k, vocab_size))
        sorted_logits.masked_fill_(sorted_logits < cut, -float("inf"))
    if top_p is not None:
        # the positions top-p keeps are a leading run (the mass before a position only grows): the last one's
        # value is the cut
        num_kept = (~_beyond_p(sorted_logits.softmax(dim=-1), top_p)).sum(dim=-1, keepdim=True)
        cut = torch.maximum(cut, sorted_logits.gather(1, num_kept - 1))
    logits.masked_fill_(logits < cut, -float("inf"))


def _kept_counts(top_k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)


def _kth(sorted_values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[R, 1]: each row's ``k``-th largest value, of values sorted largest first."""
    return sorted_values.gather(1, (k - 1)[:, None])


def _beyond_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, n]: True at sorted positions whose mass before them reaches ``top_p``, never the first: the most
    likely token always stays, even where a top_p as small as 1e-300 is 0 in fp32."""
    mass_before = probs.cumsum(dim=-1) - probs
    beyond = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    beyond[:, 0] = False
    return beyond


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below ``min_p`` times the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, -float("inf"))
