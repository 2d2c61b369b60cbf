"""The scheduler's record of the runner's persistent batch, from which each step is sent as a diff of that batch.

A request is named in full once, when it enters the batch (``NewRequestData``), and after that only by its
chunk and the blocks the runner has not been sent yet (``ScheduledRequest``), so a step's size and the
scheduler's work per step do not grow with context length. A finished request's id, and a preempted one's,
go in the next diff, which drops it from the batch.

Steps are counted as they are sent and as their outputs come back: the engine's overlapped loop sends a step
before the one before is back, so the id of a request finished meanwhile still names rows in flight, and is
not to be reused until they are back.
"""

from __future__ import annotations

from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
from kvserve.sched.stopping import wants_prompt_logprobs


class RunnerBatchMirror:
    """Which requests the runner's batch holds and how many blocks of each it knows; the finished and
    preempted ids the next diff drops; the finished ids that steps in flight still name."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._has_group_tables = kv.groups.frees_blocks  # tables per KV cache group: rows carry every group's blocks
        self._num_blocks_sent: dict[str, int] = {}  # requests in the runner's batch -> blocks of theirs it knows
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        self._retiring: dict[str, int] = {}  # ids finished while a step naming them ran -> the last such step
        self.num_steps_sent = 0
        self._num_steps_back = 0  # of those, updated from their output (two apart at most: the overlapped loop)

    @property
    def has_finished_ids(self) -> bool:
        """Finished requests whose runner state the next diff must free."""
        return bool(self._finished_ids)

    def is_in_flight(self, request_id: str) -> bool:
        """Whether a finished request's id still names rows of a step not back yet."""
        return request_id in self._retiring

    def step_sent(self) -> None:
        self.num_steps_sent += 1

    def step_back(self) -> None:
        """A step's output is back: ids that only it still named are free again."""
        self._num_steps_back += 1
        if self._retiring:
            self._retiring = {rid: step for rid, step in self._retiring.items() if step > self._num_steps_back}

    def abandon(self, sched_out: SchedulerOutput) -> None:
        """A step the runner may not have applied: it counts as back, and the next diff drops its removals again."""
        self.step_back()
        self._finished_ids |= sched_out.finished_request_ids
        self._preempted_ids |= sched_out.preempted_request_ids

    def rows(
        self, scheduled: list[tuple[Request, int]], drafts: dict[str, tuple[int, ...]]
    ) -> tuple[list[ScheduledRequest], list[NewRequestData]]:
        """Each scheduled (request, tokens) pair's row of this step, in order (``drafts``: the drafts among a
        speculating request's tokens), and the requests entering the batch. One pass over the step's requests."""
        new_requests: list[NewRequestData] = []
        rows = [
            self._row(request, num_new, new_requests, drafts.get(request.request_id, ()))
            for request, num_new in scheduled
        ]
        return rows, new_requests

    def continued_rows(self, requests: list[Request]) -> list[ScheduledRequest]:
        """Rows of a step scheduled before the step in flight is back: each request decodes the token that step
        samples for it, which sits one past its computed tokens."""
        return [
            ScheduledRequest(request.request_id, request.num_computed_tokens + 1, 1, self._new_block_ids(request),
                             True, False, (), self.kv.take_null_counts(request) if self._has_group_tables else ())
            for request in requests
        ]

    def take_removals(self) -> tuple[frozenset[str], frozenset[str]]:
        """The finished and the preempted ids for the next diff, which drops them from the batch."""
        removals = frozenset(self._finished_ids), frozenset(self._preempted_ids)
        self._finished_ids.clear()
        self._preempted_ids.clear()
        return removals

    def roll_back_rejected(self, request: Request) -> None:
        """After a verified row: free the blocks taken only for rejected drafts. The runner drops them from its
        table by the same rule (``PersistentBatch.drop_rejected_blocks``: the blocks the known tokens need), so
        the count of blocks it knows is the request's count of blocks after the free."""
        if request.is_finished:
            return
        self.kv.free_tail(request, request.num_tokens)
        self._num_blocks_sent[request.request_id] = len(request.block_ids)

    def mark_preempted(self, request_id: str) -> None:
        """The request left the running set: if it was in the batch, the next diff drops its rows."""
        if self._num_blocks_sent.pop(request_id, None) is not None:
            self._preempted_ids.add(request_id)

    def mark_finished(self, request_id: str) -> None:
        """The request finished: the next diff frees its runner state, and a step not back yet keeps its id."""
        self._num_blocks_sent.pop(request_id, None)
        self._finished_ids.add(request_id)
        if self._num_steps_back < self.num_steps_sent:
            self._retiring[request_id] = self.num_steps_sent

    def _row(
        self, request: Request, num_new: int, new_requests: list[NewRequestData], draft: tuple[int, ...]
    ) -> ScheduledRequest:
        """The request's row of this step; a request not in the runner's batch yet is named in full."""
        num_sent = self._num_blocks_sent.get(request.request_id)
        if num_sent is None:
            new_requests.append(_new_request_data(request, self.kv.tables(request)))
            self._num_blocks_sent[request.request_id] = len(request.block_ids)
        end = request.num_computed_tokens + num_new - len(draft)  # drafts are not the request's tokens yet
        return ScheduledRequest(
            request.request_id,
            request.num_computed_tokens,
            num_new,
            self._new_block_ids(request),
            end == request.num_tokens and request.pooling_params is None,
            request.sampling_params.prompt_logprobs is not None and wants_prompt_logprobs(request, end),
            draft,
            self.kv.take_null_counts(request) if self._has_group_tables else (),
        )

    def _new_block_ids(self, request: Request) -> tuple[int, ...]:
        """The request's blocks the runner has not been sent yet (every group's, group after group, the same
        number each); from now on it is counted as having them."""
        num_sent, num_blocks = self._num_blocks_sent[request.request_id], len(request.block_ids)
        self._num_blocks_sent[request.request_id] = num_blocks
        if num_sent >= num_blocks:
            return ()
        if self._has_group_tables:
            return tuple(b for table in self.kv.tables(request) for b in table[num_sent:])
        return tuple(request.block_ids[num_sent:])


def _new_request_data(request: Request, tables: list[list[int]]) -> NewRequestData:
    return NewRequestData(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=list(request.output_token_ids),
        sampling_params=request.sampling_params,
        block_ids=[b for table in tables for b in table],
        sample_index=request.sample_index,
        eos_token_ids=request.eos_token_ids,
        lora_id=request.lora_id,
        pooling_params=request.pooling_params,
    )
