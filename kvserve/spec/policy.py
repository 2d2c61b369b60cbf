"""SpeculationPolicy: which running requests speculate, how many tokens each proposes, and the counters.

The scheduler asks it for a request's draft each step and reports back how many draft tokens the runner
accepted. It runs no model: ``ngram`` drafts come from the request's own history (``spec/ngram.py``), and
``draft`` drafts are slots that the runner's draft model fills (``spec/proposer.py``). Any request may
speculate, whatever its sampling: the sampler verifies each draft position as plain decoding would have
sampled it there (``sample/rejection.py``).
"""

from __future__ import annotations

import math

from kvserve.config import SpeculativeConfig
from kvserve.request import Request
from kvserve.spec.ngram import NgramProposer
from kvserve.spec.proposer import DraftModelSlots, Proposer

# Verification turns each speculating decode into a (1 + k)-token chunk. With many decodes in a step the
# forward pass is already busy (compute-bound on CPU, and the batch fills the GPU), so extra positions cost
# about their full price while a rejected one buys nothing: past this many running requests, none speculates.
MAX_RUNNING_TO_SPECULATE = 4

# Per request, an exponential average of its acceptance rate (accepted / proposed) scales k down; below
# MIN_ACCEPTANCE_RATE the request stops proposing, and the average creeps back up by RATE_RECOVERY per step
# without proposals, so that a request whose text starts repeating later is probed again.
ACCEPTANCE_SMOOTHING = 0.5
MIN_ACCEPTANCE_RATE = 0.2
RATE_RECOVERY = 0.02


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = _proposer(config)
        self._acceptance: dict[str, float] = {}  # request id -> smoothed acceptance rate
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0

    def draft(self, request: Request, num_running: int, max_draft: int) -> tuple[int, ...]:
        """The tokens ``request`` (a decode: all but its last token computed) proposes this step, at most
        ``max_draft``; empty when it does not speculate."""
        if num_running > MAX_RUNNING_TO_SPECULATE:
            return ()
        k = min(self._num_to_propose(request.request_id), max_draft)
        if k < 1:
            return ()
        return self.proposer.propose(request, k)

    def record(self, request_id: str, num_draft: int, num_emitted: int) -> None:
        """A verified row: ``num_draft`` proposed, ``num_emitted`` tokens came back (accepted drafts + 1)."""
        num_accepted = num_emitted - 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_emitted
        rate = self._acceptance.get(request_id, 1.0)
        self._acceptance[request_id] = rate + ACCEPTANCE_SMOOTHING * (num_accepted / num_draft - rate)

    def drop(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.drop(request_id)

    def stats(self) -> dict[str, int | float]:
        drafted = self.num_draft_tokens
        return {
            "spec_decode_num_draft_tokens": drafted,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_emitted_tokens": self.num_emitted_tokens,
            "spec_decode_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
        }

    def _num_to_propose(self, request_id: str) -> int:
        rate = self._acceptance.get(request_id, 1.0)
        if rate < MIN_ACCEPTANCE_RATE:
            self._acceptance[request_id] = rate + RATE_RECOVERY
            return 0
        return math.ceil(self.config.num_speculative_tokens * rate)


def _proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "draft":
        return DraftModelSlots()
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
