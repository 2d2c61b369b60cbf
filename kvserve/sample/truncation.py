"""Truncation of temperature-scaled logits [R, V], in place, inside the sampler's draw: top-k and top-p
(one shared sort), then min-p. Masked tokens become -inf; greedy rows never come here."""

from __future__ import annotations

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Keep each row's ``top_k`` largest logits (0: all), then the smallest set of those whose probability
    reaches ``top_p`` (1: all); the rest become -inf. One sort serves both."""
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
        beyond_k = torch.arange(vocab_size, device=logits.device)[None, :] >= k[:, None]
        sorted_logits.masked_fill_(beyond_k, -float("inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # the most likely token always stays: its mass_before is 0 < top_p
        beyond_p = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits.masked_fill_(beyond_p, -float("inf"))
    logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below ``min_p`` times the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, -float("inf"))
