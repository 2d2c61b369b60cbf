"""Whether reading a prefix's blocks back from the disk tier beats computing them again, both costs measured as
the engine runs: the KV store brings a block back from the disk "whenever loading is cheaper than recomputing".

On a CPU a prefill token of the default model costs a fraction of a millisecond and its K/V a few tens of KB,
so reading wins by an order of magnitude or more. On a GPU an 8B model prefills tens of thousands of tokens a
second while a block of its K/V (2 MiB at 16 tokens) comes off the disk at page-cache speed: the two can be
close, and a slow disk loses. So a read is skipped only on evidence: once at least ``MIN_OBSERVATIONS`` of each
cost have been seen, and the read is measured ``SKIP_FACTOR`` times slower than recomputing the block. Until
then, and whenever it is close, the disk is read (the tiers' behaviour before this check). Host-tier blocks are
always loaded: a copy over PCIe or within memory is far cheaper than any prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_OBSERVATIONS = 4
SKIP_FACTOR = 2.0
MIN_PREFILL_TOKENS = 32  # a step with fewer prefill tokens says little about their cost
SMOOTHING = 0.25  # weight of each new observation in the running average


@dataclass
class ReloadCosts:
    """The running average of a prefill token's share of its step's time, from steps that were mostly prefill
    (``observe_step``), and the decision against the disk tier's measured read time of a block."""

    seconds_per_prefill_token: float = 0.0
    num_observations: int = 0

    def observe_step(self, num_prefill_tokens: int, num_tokens: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens, ``num_prefill_tokens`` of them prefill, took ``seconds`` (from the
        previous step's tokens coming back to its own): counted when prefill is most of it."""
        if num_prefill_tokens < MIN_PREFILL_TOKENS or 2 * num_prefill_tokens < num_tokens or seconds <= 0:
            return
        per_token = seconds / num_prefill_tokens
        self.seconds_per_prefill_token = (per_token if not self.num_observations else
                                          (1 - SMOOTHING) * self.seconds_per_prefill_token + SMOOTHING * per_token)
        self.num_observations += 1

    def disk_read_pays(self, read_seconds_per_block: float | None, num_disk_reads: int, block_size: int) -> bool:
        """Whether to read blocks from the disk rather than recompute them: unless both costs are known from
        enough observations and reading a block is ``SKIP_FACTOR`` times slower than computing its tokens."""
        if (read_seconds_per_block is None or num_disk_reads < MIN_OBSERVATIONS
                or self.num_observations < MIN_OBSERVATIONS):
            return True
        return read_seconds_per_block < SKIP_FACTOR * block_size * self.seconds_per_prefill_token
