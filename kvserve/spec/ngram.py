"""N-gram (prompt-lookup) proposals: the tokens that followed the latest earlier occurrence of the last n tokens.

    history:  ... a b c x y ... a b c | (last 3 tokens "a b c")
                  ^^^^^ earlier match: propose "x y ..." (k tokens)

A match close to the end continues into the draft itself: the history is taken to repeat with the period
between the match and the end, so ``1 2 1 2`` proposes ``1 2 1 2 ...``, not just ``1 2``.

No model runs: a request that repeats itself (code edits, quoting its prompt, lists) gets drafts for free,
and the target model verifies them. The search is vectorised over the history with numpy: one comparison
pass per n-gram position (``max_n`` of them), not a Python loop per token.
"""

from __future__ import annotations

import numpy as np

from kvserve.request import Request
from kvserve.spec.proposer import Proposer


class NgramProposer(Proposer):
    """``ngram``: drafts from the request's own history (``propose_ngram``)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._prompts: dict[str, np.ndarray] = {}  # request id -> its prompt as an array, made once

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        return tuple(propose_ngram(self._history(request), self.min_n, self.max_n, k).tolist())

    def drop(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)

    def _history(self, request: Request) -> np.ndarray:
        prompt = self._prompts.get(request.request_id)
        if prompt is None:
            prompt = self._prompts[request.request_id] = np.array(request.prompt_token_ids, dtype=np.int64)
        return np.concatenate((prompt, np.array(request.output_token_ids, dtype=np.int64)))


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """``k`` tokens following the most recent earlier occurrence of the history's last n tokens, for the
    largest n in ``[min_n, max_n]`` that occurs (repeating with the match's period where the history runs
    out); an empty array when none occurs."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return token_ids[:0]
    # ends[i]: a position before the last one holding the last token; an n-gram match ends there
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    match_len = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, num_tokens - 1)):
        starts = ends - back
        alive &= starts >= 0
        alive[alive] &= token_ids[starts[alive]] == token_ids[num_tokens - 1 - back]
        if not alive.any():
            break
        match_len += alive
    longest = min(int(match_len.max(initial=0)), max_n)
    if longest < min_n:
        return token_ids[:0]
    end = int(ends[np.flatnonzero(match_len >= longest)[-1]])
    period = num_tokens - 1 - end
    return token_ids[end + 1 + np.arange(k) % period]
