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

from typing import Sequence

import numpy as np

from kvserve.request import Request
from kvserve.spec.proposer import Proposer


class NgramProposer(Proposer):
    """``ngram``: drafts from the request's own history (``propose_ngram``)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._histories: dict[str, _History] = {}  # request id -> its history as an array, grown as outputs come

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        history = self._histories.get(request.request_id)
        if history is None:
            history = self._histories[request.request_id] = _History(request.prompt_token_ids)
        return tuple(propose_ngram(history.tokens(request.output_token_ids), self.min_n, self.max_n, k).tolist())

    def drop(self, request_id: str) -> None:
        self._histories.pop(request_id, None)


class _History:
    """A request's prompt and outputs in one int64 array that grows as outputs come (its capacity doubling):
    converting the whole output list at every step was three quarters of a proposal's cost at 16k outputs."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self._tokens = np.empty(max(64, 2 * len(prompt)), dtype=np.int64)
        self._tokens[: len(prompt)] = prompt
        self._num_prompt = self._length = len(prompt)

    def tokens(self, outputs: Sequence[int]) -> np.ndarray:
        """The history with ``outputs`` (the request's, which only grow) as its outputs."""
        new = outputs[self._length - self._num_prompt :]
        end = self._length + len(new)
        if end > len(self._tokens):
            grown = np.empty(2 * end, dtype=np.int64)
            grown[: self._length] = self._tokens[: self._length]
            self._tokens = grown
        self._tokens[self._length : end] = new
        self._length = end
        return self._tokens[:end]


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
