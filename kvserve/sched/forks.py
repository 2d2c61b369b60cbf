"""n > 1 forks: the samples 1..n-1 of a request, made as requests of their own once all but its last prompt token
are computed, and the copy-on-write copies of their partial blocks, pending until the next step's plan.

A sample shares its parent's full blocks and gets a copy of the partial one (``KVCacheManager.fork``); then it
runs the last prompt token itself and samples its own first token, so that below the scheduler and the KV
manager it is an ordinary request. Where a sample runs or waits (a seat under ``max_running``, a block for its
copy) is the scheduler's to decide: it owns the queues.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.block_pool import NoFreeBlocksError
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request, RequestStatus, sample_request_id


def is_ready_to_fork(request: Request) -> bool:
    """An n > 1 request still to fork whose computed tokens are all but its last prompt token."""
    return (request.will_fork and request.status is RequestStatus.RUNNING
            and request.num_computed_tokens == request.num_prompt_tokens - 1)


def new_sample(parent: Request, index: int) -> Request:
    """Sample ``index`` of ``parent``, running at the parent's computed tokens (its KV not shared yet)."""
    return Request(
        request_id=sample_request_id(parent.request_id, index),
        prompt_token_ids=parent.prompt_token_ids,
        sampling_params=parent.sampling_params,
        eos_token_ids=parent.eos_token_ids,
        arrival_time=parent.arrival_time,
        sample_index=index,
        parent_id=parent.request_id,
        grammar=parent.grammar,
        cache_salt=parent.cache_salt,
        lora_id=parent.lora_id,
        lora_digest=parent.lora_digest,
        priority=parent.priority,
        num_computed_tokens=parent.num_computed_tokens,
        num_cached_tokens=parent.num_cached_tokens,
        first_scheduled_time=parent.first_scheduled_time,
        status=RequestStatus.RUNNING,
        num_prompt_logprobs_sent=parent.num_prompt_tokens - 1,  # the parent returns them all
    )


@dataclass(frozen=True)
class _PendingCopy:
    """A fork's copy-on-write of a partial block, applied before the next forward if the sample still runs."""

    sample: Request
    src: int
    dst: int


class ForkCopies:
    """Shares a parent's KV with its samples and holds their partial-block copies until the next plan."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._pending: list[_PendingCopy] = []

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def share_kv(self, parent: Request, sample: Request) -> bool:
        """Give ``sample`` the parent's KV: full blocks shared, the partial one copied before the next forward.
        False, sharing nothing, if no block is free for that copy."""
        try:
            copies = self.kv.fork(parent, sample)
        except NoFreeBlocksError:
            return False
        self._pending.extend(_PendingCopy(sample, src, dst) for src, dst in copies)
        return True

    def take(self) -> tuple[tuple[int, int], ...]:
        """The (src, dst) copies for the next step's plan, and no longer pending. A sample finished or preempted
        by recompute since its fork no longer owns dst: copying into it could clobber the block's next owner.
        One swapped out still needs the copy: its swap-out reads dst after it."""
        copies = tuple(
            (c.src, c.dst) for c in self._pending
            if c.sample.status is RequestStatus.RUNNING or self.kv.is_swapped_out(c.sample)
        )
        self._pending.clear()
        return copies
