"""How two lists of texts pair for scoring (vLLM's ``score`` with an embedding model, ``LLM.score`` and the server's
/score and /rerank) and each pair's score: the cosine similarity of the two embeddings."""

from __future__ import annotations

import torch


def check_score_pairs(num_first: int, num_second: int) -> None:
    """ValueError unless the sides pair as vLLM pairs them: one first text against each second one, or the i-th
    against the i-th (one text at least on each side)."""
    if not num_first or not num_second:
        raise ValueError("score needs at least one text on each side")
    if num_first > 1 and num_first != num_second:
        raise ValueError(f"{num_first} and {num_second} texts: score pairs 1 to 1, 1 to N or N to N")


def pair_scores(first: list[torch.Tensor], second: list[torch.Tensor]) -> list[float]:
    """The cosine similarity of each pair of embeddings: ``first[i]`` with ``second[i]``, or a single ``first``
    with each of ``second``."""
    check_score_pairs(len(first), len(second))
    left = torch.stack(first).expand(len(second), -1) if len(first) == 1 else torch.stack(first)
    return torch.nn.functional.cosine_similarity(left, torch.stack(second), dim=-1).tolist()
