"""Proposer: the scheduler's side of a speculation method, one per method (``SpeculationPolicy`` picks it).

A proposer decides, before the step, the draft tokens a running decode runs after its last token. ``ngram``
knows them then (``spec/ngram.py``). ``draft`` does not: its tokens come from a draft model that the runner
runs just before the target's forward pass (``worker/draft_model.py``), so the scheduler reserves the positions
(query tokens in the budget, KV slots in the request's blocks) as ``DRAFT_SLOT`` entries and the runner
fills them in. Either way a row's draft is ``ScheduledRequest.draft_token_ids``, and the scheduler reads only
its length.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvserve.request import Request

# A draft position whose token the runner's draft model fills in (never a token id: negative, so that one
# reaching a model fails loudly at the embedding)
DRAFT_SLOT = -1


class Proposer(ABC):
    @abstractmethod
    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        """Up to ``k`` draft tokens for ``request``, a decode (all but its last token computed); may be empty."""

    def drop(self, request_id: str) -> None:
        """Forget what the proposer keeps for a request that finished."""


class DraftModelSlots(Proposer):
    """``draft``: k slots for the runner's draft model (``worker/draft_model.py``) to fill with its greedy tokens."""

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        return (DRAFT_SLOT,) * k

