"""Verifying draft tokens against the target model, exactly (speculative sampling).

``probs[i]`` is the target's processed distribution at draft position i (k + 1 rows for k drafts: the last
row follows the whole draft). A draft token x is accepted with probability p(x); at the first rejection the
emitted token is drawn from p with x removed and renormalised; after k acceptances a bonus token is drawn from
the last row. For a proposer whose distribution is one-hot (n-gram lookup) this emits exactly p's samples:

    P(emit y) = p(x) [y = x] + (1 - p(x)) * p(y) [y != x] / (1 - p(x)) = p(y)

Greedy is the limit of one-hot p: drafts are accepted while they equal the argmax, so greedy output is token
for token that of plain decoding.
"""

from __future__ import annotations

from typing import Sequence

import torch


def accept_greedy(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """The accepted drafts then the target's own token: ``target[i]`` is the argmax at draft position i."""
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == target[num_accepted]:
        num_accepted += 1
    return [*draft[:num_accepted], target[num_accepted]]


def accept_sampled(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator) -> list[int]:
    """The accepted drafts then one token drawn from the residual (or bonus) distribution. Draws k uniforms
    and one row of exponentials from ``generator`` whatever happens, so a seeded request's random stream
    does not depend on how many drafts it had accepted before."""
    num_draft = len(draft)
    if probs.shape[0] != num_draft + 1:
        raise ValueError(f"{probs.shape[0]} probability rows for {num_draft} draft tokens (expected k + 1)")
    draft_ids = torch.tensor(draft, dtype=torch.long, device=probs.device)
    p_draft = probs[torch.arange(num_draft, device=probs.device), draft_ids]
    uniforms = torch.rand(num_draft, generator=generator, device=probs.device)
    rejected = torch.nonzero(uniforms >= p_draft)
    num_accepted = int(rejected[0]) if len(rejected) else num_draft
    residual = probs[num_accepted].clone()
    if num_accepted < num_draft:
        residual[draft[num_accepted]] = 0.0  # renormalising is implicit in the draw below
    return [*draft[:num_accepted], draw(residual, generator)]


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token with probability proportional to ``weights`` [V] (an exponential race, as the sampler's)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int(weights.div(noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax())
