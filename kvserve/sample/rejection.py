"""Verifying draft tokens against the target model, exactly (speculative sampling).

A speculating request has k + 1 rows: row j holds the target's processed distribution p_j after the first j
draft tokens, and the sampler draws the target's own choice x_j from each row exactly as it draws any token
(the argmax for greedy; for random sampling the exponential race ``argmax(p_j / q_j)``, ``q_j ~ Exp(1)``).
The request keeps its drafts while they equal the target's choices, then emits the target's choice at the
first disagreement (or after the last draft)::

    draft:   d1  d2  d3          choices:  x0 = d1, x1 = d2, x2 != d3, x3
    emits:   d1  d2  x2          (x3 is discarded with d3)

This is the rejection rule of speculative sampling for a one-hot proposer (n-gram lookup): d is accepted when
x = d, which has probability p(d), and given x != d, x is distributed as p with d removed and renormalised::

    P(emit y) = p(d) [y = d] + (1 - p(d)) * p(y) [y != d] / (1 - p(d)) = p(y)

The choices after a rejection are never looked at, so each emitted token is a fresh draw from its position's
distribution. Every emitted token is the token plain decoding would draw at its position with the same
noise: greedy output is plain decoding's token for token, and so is a seeded request's, whose noise at each
output position depends only on its seed, its sample index and the position (``Sampler``).
"""

from __future__ import annotations

from typing import Sequence


def accept_draft(draft: Sequence[int], choices: Sequence[int]) -> list[int]:
    """The tokens a speculating request emits: its drafts while ``draft[j] == choices[j]``, then the target's
    choice at the first disagreement. ``choices[j]`` is the target's token at row j (k + 1 of them)."""
    if len(choices) != len(draft) + 1:
        raise ValueError(f"{len(choices)} target tokens for {len(draft)} draft tokens (expected k + 1)")
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == choices[num_accepted]:
        num_accepted += 1
    return [*draft[:num_accepted], choices[num_accepted]]
