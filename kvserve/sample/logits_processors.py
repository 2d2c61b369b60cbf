"""Logits processors: in-place transforms of fp32 logits [N, V], one row per sampling row.

Two groups, applied in vLLM's order:

- history processors, on every row before the greedy/random split: logit bias, the min_tokens ban,
  the repetition penalty (prompt + outputs), presence and frequency penalties (outputs);
- truncation, on temperature-scaled logits of the rows that draw: top-k and top-p (one shared sort), min-p.

Each processor touches only the rows that need it; per-row values travel as [R, 1] tensors.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np
import torch

from kvserve.sample.metadata import SamplingRow


def apply_history_processors(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Bias, min_tokens ban, repetition penalty, then presence / frequency penalties, in place."""
    apply_logit_bias(logits, rows)
    apply_min_tokens(logits, rows)
    apply_repetition_penalty(logits, rows)
    apply_presence_frequency_penalties(logits, rows)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's ``logit_bias[token]`` to its logit."""
    entries = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()]
    if not entries:
        return
    row_ids, token_ids, biases = zip(*entries)
    _check_token_ids(token_ids, logits.shape[1], "logit_bias")
    index = (_long(row_ids, logits.device), _long(token_ids, logits.device))
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Mask EOS and stop tokens to -inf in rows that have fewer than ``min_tokens`` outputs."""
    entries = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
    if not entries:
        return
    row_ids, token_ids = zip(*entries)
    _check_token_ids(token_ids, logits.shape[1], "eos / stop_token_ids")
    logits[_long(row_ids, logits.device), _long(token_ids, logits.device)] = -float("inf")


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """For tokens seen in the prompt or the outputs: positive logits divided by the penalty, others multiplied."""
    selected = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not selected:
        return
    index = _long(selected, logits.device)
    sub = logits[index]
    histories = [itertools.chain(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in selected]
    seen = token_counts(histories, sub.shape[1], sub.device) > 0
    penalty = _column([rows[i].params.repetition_penalty for i in selected], sub)
    penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[index] = torch.where(seen, penalized, sub)


def apply_presence_frequency_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Subtract ``frequency_penalty * count + presence_penalty * (count > 0)`` over output tokens."""
    selected = [
        i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
    ]
    if not selected:
        return
    index = _long(selected, logits.device)
    sub = logits[index]
    counts = token_counts([rows[i].output_token_ids for i in selected], sub.shape[1], sub.device)
    frequency = _column([rows[i].params.frequency_penalty for i in selected], sub)
    presence = _column([rows[i].params.presence_penalty for i in selected], sub)
    logits[index] = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)


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


def token_counts(histories: Sequence[Iterable[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float counts of each token in each row's history."""
    flat = [np.fromiter(h, dtype=np.int64) for h in histories]
    lengths = [len(f) for f in flat]
    row_ids = np.repeat(np.arange(len(flat)), lengths)
    counts = torch.zeros(len(flat), vocab_size, device=device)
    if sum(lengths):
        token_ids = np.concatenate(flat)
        _check_token_ids(token_ids, vocab_size, "history")
        index = (torch.from_numpy(row_ids).to(device), torch.from_numpy(token_ids).to(device))
        counts.index_put_(index, torch.ones(len(token_ids), device=device), accumulate=True)
    return counts


def _check_token_ids(token_ids: Sequence[int] | np.ndarray, vocab_size: int, what: str) -> None:
    ids = np.asarray(token_ids, dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        shown = sorted(set(bad.tolist()))[:8]
        raise ValueError(f"{what}: token ids {shown} are outside the vocabulary [0, {vocab_size})")


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]
