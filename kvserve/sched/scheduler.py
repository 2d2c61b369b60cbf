"""Scheduler: assigns tokens to requests under a token budget (vLLM v1 style: tokens, not phases).

A step gives each request ``min(num_tokens - num_computed_tokens, budget left)`` tokens: 1 for a decode,
the next chunk for a prompt (or a recompute after preemption). Running requests go first, in admission
order, then waiting requests, in arrival order (``fcfs``) or longest cached prefix first (``lpm``). A waiting
request starts from its longest cached prefix, and waits while a running request is still computing the
next blocks of that prefix, so that requests arriving together compute a shared prefix once. When KV runs
out for a running request, the newest running request is preempted and waits, at the front. By recompute
(``preemption_mode="recompute"``), its blocks are freed (the computed ones stay cached) and it runs its tokens
again. By swap (``"swap"``), the KV manager copies its KV to the host tier and frees its blocks; it keeps its
``num_computed_tokens``, and when it is admitted again its prefix match is that KV, which the manager loads
into fresh blocks, so it computes nothing again. A swap the host tier cannot take falls back to recompute.

Under ``priority`` (vLLM's policy) each request has a rank, its priority then its arrival (the lower, the
sooner). The waiting queue is kept in rank order, its head the first to admit; running requests keep admission
order (each running decode still gets its token before a newer request's prompt chunk) and the one preempted
when KV runs out is the lowest ranked, as in vLLM's v1: if the loop had already given it tokens this step, they
go back to the budget. The head of the waiting queue also displaces running requests of a higher priority value
(the lowest ranked first) until it has a seat and the blocks for its first chunk, as vLLM's v0 priority
scheduler did (its v1 preempts only for a running request's blocks, so a queue of urgent requests waited out
every long low-priority one holding a seat). Requests of equal priority never displace each other, so the
policy cannot thrash among them.

A step's ``SchedulerOutput`` is a diff of the runner's batch (``batch_diff.py``). A request with n > 1 forks
once, when all but its last prompt token are computed, into samples that share its KV (``forks.py``); where a
request's tokens end, and which prompt logprobs it still owes, are rules of the request alone (``stopping.py``).

A running decode may speculate (``spec/``): it runs its last token plus k drafted tokens as one chunk, and
``update_from_output`` advances it by the accepted drafts + 1 only; blocks taken just for rejected drafts are
freed, and drafts never enter ``output_token_ids``, so the prefix tree never holds a rejected token.

The scheduler owns request status, ``num_computed_tokens`` and ``output_token_ids``; blocks belong to the
``KVCacheManager``. Admission refuses a request that could never fit, so the oldest running request can
always make progress and the loop never deadlocks.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from kvserve.config import ModelConfig, SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix_cache import PrefixMatch
from kvserve.kv.swap import SwapCounters, SwappedKV
from kvserve.outputs import FinishReason
from kvserve.request import SAMPLE_ID_SEPARATOR, Request, RequestStatus
from kvserve.sampling_params import InvalidParameter
from kvserve.sched.batch_diff import RunnerBatchMirror
from kvserve.sched.forks import ForkCopies, is_ready_to_fork, new_sample
from kvserve.sched.output import (
    EngineOutput,
    KVTransferPlan,
    ModelOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from kvserve.sched.stopping import new_prompt_logprobs, num_tokens_left, stop_reason, stops_after_next_token
from kvserve.sched.waiting_queue import WaitingQueue
from kvserve.spec.policy import SpeculationPolicy

if TYPE_CHECKING:
    import torch


# Waiting requests a step looks at, from the head of the queue (those behind wait their turn), and how many of
# them lpm orders by cached prefix (SGLang's scheduler falls back to arrival order past 128 waiting)
WAITING_SCAN = 1024
LPM_WINDOW = 128


@dataclass
class _Budget:
    num_tokens: int
    num_seqs: int

    def has_room(self) -> bool:
        return self.num_tokens > 0 and self.num_seqs > 0

    def take(self, num_tokens: int) -> None:
        self.num_tokens -= num_tokens
        self.num_seqs -= 1

    def give_back(self, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        self.num_seqs += 1


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, speculation: SpeculationPolicy | None = None,
        pooling_type: str = ModelConfig.pooling_type,
    ) -> None:
        """``pooling_type``: how the runner pools ``embed`` requests (``ModelConfig.pooling_type``), which decides
        whether they may start from a cached prefix."""
        self.config = config
        self.kv = kv
        self.speculation = speculation
        self.pooling_type = pooling_type
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # of those, how many run with each LoRA adapter (none for the base model): an adapter removed while in use
        # stays installed until its count is gone (``engine/lora_adapters.py``)
        self.num_requests_by_adapter: Counter[int] = Counter()
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self._batch_mirror = RunnerBatchMirror(kv)
        self._fork_copies = ForkCopies(kv)
        self.num_preemptions = 0  # running requests preempted, since start
        self.num_tokens_computed = 0  # tokens run through the model, recomputed ones included
        self.num_prefix_query_tokens = 0  # tokens of newly admitted requests looked up in the prefix cache
        self.num_prefix_hit_tokens = 0  # of those, found cached
        self.num_continued_steps = 0  # steps scheduled before the tokens of the step before were back
        # unfinished requests -> steps sent before they arrived (aging: lpm's order, a LoRA slot waited for)
        self._arrival_step: dict[str, int] = {}

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        """Requests still running, or finished ones whose runner state the next step's diff must free."""
        return bool(self.requests) or self._batch_mirror.has_finished_ids

    def preemption_stats(self) -> dict[str, int | str]:
        """Preemptions since start (a sample of an n > 1 request that finds no block for its fork's copy is one);
        with swap, the requests and blocks swapped out and in, and the swap-outs that fell back to recompute (the
        host tier had no room)."""
        swap = self.kv.swap.counters if self.kv.swap is not None else SwapCounters()
        return {
            "preemption_mode": self.config.preemption_mode,
            "num_preemptions": self.num_preemptions,
            "num_swapped_out": swap.num_swapped_out,
            "num_swapped_in": swap.num_swapped_in,
            "num_blocks_swapped_out": swap.num_blocks_swapped_out,
            "num_blocks_swapped_in": swap.num_blocks_swapped_in,
            "num_blocks_swap_in_found_on_device": swap.num_blocks_found_on_device,
            "num_swap_fallbacks": swap.num_fallbacks,
        }

    def prefix_cache_stats(self) -> dict[str, int | float | bool]:
        """Prefix-cache figures since start: lookups and hits in tokens, hit rate, cached blocks, evictions."""
        queries, hits = self.num_prefix_query_tokens, self.num_prefix_hit_tokens
        return {
            "prefix_caching": self.kv.prefix_cache is not None,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "prefix_cache_blocks": self.kv.num_cached_blocks,
            "prefix_cache_evictions": self.kv.num_evictions,
        }

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError, queuing nothing, if it is a duplicate or could never fit."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self._batch_mirror.is_in_flight(request.request_id):  # that step's rows would land on this request
            raise ValueError(f"request id {request.request_id!r} is still in a step in flight: use another id")
        if SAMPLE_ID_SEPARATOR in request.request_id:
            raise ValueError(
                f"request id {request.request_id!r} contains {SAMPLE_ID_SEPARATOR!r}, which is kept for the ids "
                "of the samples of an n > 1 request"
            )
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidParameter("priority", f"priority {request.priority} needs the priority scheduling policy "
                                   f"(--scheduling-policy priority); this engine schedules by "
                                   f"{self.config.scheduling_policy}")
        self._check_fits(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._count_adapter(request, 1)
        self._arrival_step[request.request_id] = self._batch_mirror.num_steps_sent
        self._enqueue(request)

    def _check_fits(self, request: Request) -> None:
        """Refuse what could never run, so that no admitted request can deadlock the loop."""
        num_prompt = request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        max_model_len = self.config.max_model_len
        if request.pooling_params is not None:  # draws no token: its prompt alone
            max_tokens = 0
        num_needed = num_prompt + (1 if max_tokens is None else max_tokens)  # None: generate until max_model_len
        if num_needed > max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({num_prompt} tokens) + max_tokens "
                f"({num_needed - num_prompt}) "
                f"= {num_needed} is over max_model_len={max_model_len}"
            )
        max_len = max_model_len if max_tokens is None else num_needed
        max_blocks = self.kv.max_blocks_for(max_len, self.config.max_num_batched_tokens)
        if max_blocks > self.kv.num_blocks_total:
            capacity = (f"it needs up to {max_blocks} of the pool's {self.kv.num_blocks_total} blocks across its KV "
                        "cache groups" if self.kv.groups.frees_blocks else
                        f"{self.kv.num_blocks_total} blocks x {self.kv.block_size} = {self.kv.num_slots_total} tokens")
            raise ValueError(f"request {request.request_id!r} may grow to {max_len} tokens, over the whole KV cache "
                             f"({capacity})")

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> None:
        """Finish requests now (abort, or a stop string seen by the frontend), freeing their blocks at once;
        works whether they wait, run or are preempted. Unknown or already finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, reason)

    def abandon(self, steps: Sequence[SchedulerOutput]) -> None:
        """A step raised, in the runner or while it was scheduled: nothing since the last step back is trusted.
        ``steps`` (scheduled, not back) count as back, and their removals go in the next diff again (the runner may
        not have applied them; it ignores ids it does not hold). Every live request finishes aborted without
        committing what it was to compute, load or swap in (its pending blocks leave the tree; what a half-done
        schedule set up goes with it). The KV moves planned and never applied are the KV manager's to drop
        (``abandon_transfers``)."""
        for sched_out in steps:
            self._batch_mirror.abandon(sched_out)
        for request in list(self.requests.values()):
            self._finish(request, FinishReason.ABORT, commit=False)

    # ----------------------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then waiting ones while the budget and KV allow.
        Mutates the queues and the block tables, and ``num_computed_tokens`` only at the edges of a request's
        residence: set to its cached prefix (or its swapped-in KV) on admission, reset to 0 on preemption by
        recompute (a sample that waits for a seat or a block included). ``update_from_output`` is the only place
        it advances by computed tokens."""
        self._batch_mirror.step_sent()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_running)
        scheduled: list[tuple[Request, int]] = []
        drafts: dict[str, tuple[int, ...]] = {}
        if self.config.scheduling_policy == "priority":
            self._displace_for_waiting()
        num_preempted = self._schedule_running(budget, scheduled, drafts)
        if not num_preempted:  # memory is tight when preempting: admitting now would only thrash
            self._schedule_waiting(budget, scheduled)
        requests, new_requests = self._batch_mirror.rows(scheduled, drafts)
        num_tokens = sum(num_new for _, num_new in scheduled)
        if num_tokens > len(requests):  # one-token rows first, in order, then the chunks
            requests = [r for r in requests if r.num_tokens == 1] + [r for r in requests if r.num_tokens > 1]
        self.num_tokens_computed += num_tokens
        return SchedulerOutput(
            requests, num_tokens, new_requests, self._take_kv_transfers(), *self._batch_mirror.take_removals()
        )

    def schedule_continuation(self, previous: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``previous``, scheduled before ``previous``'s tokens are back (the engine's overlapped
        loop; ``update_from_output(previous)`` comes later, then this step's): each request ``previous``
        decoded and still running decodes the token ``previous`` samples for it, which the runner takes
        from the device. A request sure to stop at that token (its max_tokens or max_model_len) is left out;
        one that stops at it otherwise (EOS, a stop token) runs this step for nothing and its token is dropped.

        None where ``schedule`` should decide after the update: a waiting request could be admitted now
        (``_could_admit``; one that could not waits for a step in which requests stop and free their blocks,
        which a plain step would see one step sooner), a row of ``previous`` is not a one-token decode, KV
        tiers, fork copies or speculation (whose drafts are chosen from the tokens read back) are in play, or
        a request's next token needs a block the pool cannot give (which ``schedule`` would preempt for;
        blocks taken by then for the others stay theirs, as their next step needs them anyway). The diff
        leaves finished and preempted requests to the next ``schedule``: the runner still has ``previous``'s
        tokens to record for them."""
        if (self._could_admit() or self._fork_copies.has_pending or self.kv.store is not None
                or self.speculation is not None):
            return None
        if any(r.num_tokens != 1 or not r.sample or r.draft_token_ids for r in previous.requests):
            return None
        continuing = [request for r in previous.requests
                      if (request := self.requests.get(r.request_id)) is not None
                      and request.status is RequestStatus.RUNNING
                      and not stops_after_next_token(request, self.config.max_model_len)]
        if not continuing or len(continuing) > self.config.max_num_batched_tokens:
            return None
        # the token ``previous`` samples sits one past the known ones: its slot for every request, or no step
        if not all(self.kv.allocate_slots(request, 2) for request in continuing):
            return None
        self._batch_mirror.step_sent()
        self.num_continued_steps += 1
        self.num_tokens_computed += len(continuing)
        return SchedulerOutput(self._batch_mirror.continued_rows(continuing), len(continuing))

    def _could_admit(self) -> bool:
        """Whether ``schedule`` could admit a waiting request now: the request first in the queue fits
        (``_fits_now``), or (``priority``) it would displace running ones. The head alone, not the one lpm would
        try first: ordering the queue here cost 6-11 ms a continued step (a prefix match for each of the first 128
        waiting), where a request whose prefix is cached waits at most until the head fits."""
        return bool(self.waiting) and (
            self._outranks_a_running_request(self.waiting.head) or self._fits_now(self.waiting.head))

    def _fits_now(self, request: Request) -> bool:
        """A seat in the batch, room for its LoRA adapter, and free blocks for the request's first chunk beyond its
        cached prefix."""
        if len(self.running) >= self.config.max_running:
            return False
        if request.lora_id and not self._adapter_fits(request, self._running_adapters()):
            return False
        num_new = min(request.num_tokens - self._match_prefix(request).num_tokens, self.config.max_num_batched_tokens)
        return self.kv.max_blocks_for(num_new, num_new) <= self.kv.num_free_blocks()

    def _outranks_a_running_request(self, request: Request) -> bool:
        """``priority``: the request's priority value is lower than the lowest ranked running request's."""
        return (self.config.scheduling_policy == "priority" and bool(self.running)
                and request.priority < self._victim().priority)

    def _displace_for_waiting(self) -> None:
        """``priority``: preempt running requests of a higher priority value than the head of the waiting queue,
        the lowest ranked first, until the head fits (it is admitted by ``_schedule_waiting``, unless running
        requests' own blocks preempt more first). One head a step: the next waits for the next step. Not for a
        head that waits for a running request to compute its prefix: it would not be admitted this step."""
        head = self.waiting.head if self.waiting else None
        if head is None or self._match_prefix(head).must_wait:
            return
        # the running requests it does not outrank holding every adapter slot, displacing the others seats it no sooner
        if head.lora_id and not self._adapter_fits(head, {r.lora_id for r in self.running
                                                          if r.priority <= head.priority}):
            return
        while self._outranks_a_running_request(self.waiting.head) and not self._fits_now(self.waiting.head):
            self._preempt(self._victim())

    def _schedule_running(
        self, budget: _Budget, scheduled: list[tuple[Request, int]], drafts: dict[str, tuple[int, ...]]
    ) -> int:
        """Give each running request its next tokens (plus a draft, if it speculates), preempting one (``_victim``:
        the newest; the lowest ranked under ``priority``) when KV runs out; returns the number preempted. The newest
        comes from the tail, which this loop has not reached yet; the lowest ranked may have had its tokens this
        step already, and they go back to the budget. A draft never preempts: without the blocks for it, the
        request decodes one token."""
        num_preempted = 0
        index = 0
        while index < len(self.running) and budget.has_room():
            request = self.running[index]
            num_new = min(num_tokens_left(request, request.num_computed_tokens), budget.num_tokens)
            draft = self._draft(request, budget, len(self.running) - index - 1) if num_new == 1 else ()
            if draft and self.kv.allocate_slots(request, 1 + len(draft)):
                drafts[request.request_id] = draft
                num_new += len(draft)
            else:
                while not self.kv.allocate_slots(request, num_new):
                    num_preempted += 1
                    victim = self._victim()
                    if self.running.index(victim) < index:  # scheduled already this step: undo it
                        index -= 1
                        self._unschedule(victim, budget, scheduled, drafts)
                    self._preempt(victim)
                    if victim is request:
                        return num_preempted
            scheduled.append((request, num_new))
            budget.take(num_new)
            index += 1
        return num_preempted

    @staticmethod
    def _unschedule(request: Request, budget: _Budget, scheduled: list[tuple[Request, int]],
                    drafts: dict[str, tuple[int, ...]]) -> None:
        """Take back the tokens (and draft) this step gave ``request``, which is about to be preempted."""
        position = next(i for i, (r, _) in enumerate(scheduled) if r is request)
        budget.give_back(scheduled.pop(position)[1])
        drafts.pop(request.request_id, None)

    def _draft(self, request: Request, budget: _Budget, num_running_behind: int) -> tuple[int, ...]:
        """The request's draft tokens this step: only for a decode (all but its last token computed), and no
        more than fit the step's budget or could be kept under max_tokens and max_model_len (a verified row
        emits up to len(draft) + 1 tokens). Drafts take only what is left of the budget after a token for each
        running request behind this one and one for the head of the waiting queue (where a seat is free):
        taken in admission order, they starved the others of a small budget for many steps."""
        if self.speculation is None or request.num_computed_tokens != request.num_tokens - 1:
            return ()
        seat_free = bool(self.waiting) and len(self.running) < self.config.max_running
        left = budget.num_tokens - num_running_behind - (1 if seat_free else 0)
        room = min(left, self.config.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens)
        return self.speculation.draft(request, len(self.running), room - 1)

    def _schedule_waiting(self, budget: _Budget, scheduled: list[tuple[Request, int]]) -> None:
        """Admit waiting requests in policy order while their chunk's blocks fit; never preempts to make
        room. One whose prefix a running request is still computing is passed over this step."""
        if not self.waiting or len(self.running) >= self.config.max_running:
            return  # before ordering the queue: under lpm that matches every waiting request's prefix
        admitted: set[Request] = set()
        adapters = self._running_adapters()
        adapters_held = False  # a request has waited long for an adapter slot: no adapter's request goes past it
        try:
            for request in self._waiting_in_policy_order():
                if not budget.has_room() or len(self.running) >= self.config.max_running:
                    break
                if request.lora_id and adapters_held:
                    continue  # the running adapters drain, so that the one waiting long gets its slot
                if not self._adapter_fits(request, adapters):
                    # its adapter would be one too many in the step: it waits for one to leave; past
                    # lpm_aging_steps, others' requests are no longer admitted around it (a steady stream of a busy
                    # adapter's requests starved it)
                    adapters_held = self._has_waited_long(request)
                    continue
                start = self._match_prefix(request)
                if start.must_wait:
                    continue
                num_new = min(num_tokens_left(request, start.num_tokens), budget.num_tokens)
                if not self.kv.allocate_slots(request, num_new, start):
                    break
                admitted.add(request)
                adapters.add(request.lora_id)
                self._admit(request, start)
                scheduled.append((request, num_new))
                budget.take(num_new)
        finally:  # even when interrupted (a SIGINT handler of the caller's that raises; LLM.generate itself holds
            # Ctrl-C until the step is done), a request admitted so far is in one queue
            if admitted:
                self.waiting.remove_admitted(admitted & set(self.running))

    def _running_adapters(self) -> set[int]:
        """The LoRA adapters of the running requests (0, the base model, among them where one has none); none
        counted without a limit on them (LoRA off: no pass over the running requests each step)."""
        if self.config.max_loras is None:
            return set()
        return {request.lora_id for request in self.running}

    def adapters_in_use(self) -> tuple[set[int], set[int]]:
        """The LoRA adapters of the running requests, and of the waiting ones (preempted included): a pass over
        the running requests only while one with an adapter is unfinished, none over the waiting queue."""
        if not self.num_requests_by_adapter:
            return set(), set()
        running = Counter(request.lora_id for request in self.running if request.lora_id)
        waiting = {adapter for adapter, count in self.num_requests_by_adapter.items() if count > running[adapter]}
        return set(running), waiting

    def _count_adapter(self, request: Request, change: int) -> None:
        if request.lora_id:
            self.num_requests_by_adapter[request.lora_id] += change
            if not self.num_requests_by_adapter[request.lora_id]:
                del self.num_requests_by_adapter[request.lora_id]

    def _adapter_fits(self, request: Request, adapters: set[int]) -> bool:
        """Whether the request's LoRA adapter joins ``adapters`` (the running ones) within ``max_loras``."""
        if request.lora_id == 0 or request.lora_id in adapters or self.config.max_loras is None:
            return True
        return len(adapters - {0}) < self.config.max_loras

    def _waiting_in_policy_order(self) -> list[Request]:
        """The first ``WAITING_SCAN`` requests of the queue, in the order to admit them. fcfs: queue order
        (preempted requests first); priority: queue order (rank order). lpm: among the first ``LPM_WINDOW``,
        preempted and aged requests in queue order, then the rest by longest cached prefix (the sort is stable, so
        ties keep arrival order); then the others in queue order. Ordering the whole queue matched every waiting
        request's prefix every step: with 100,000 queued that was most of each step. A list, not a view: admitting a
        request may queue its fork."""
        candidates = self.waiting.first(WAITING_SCAN)
        if self.config.scheduling_policy != "lpm" or self.kv.prefix_cache is None or len(candidates) < 2:
            return candidates
        def priority(request: Request) -> tuple[bool, int]:
            first = request.status is RequestStatus.PREEMPTED or self._has_waited_long(request)
            return (not first, 0 if first else -self._match_prefix(request).num_tokens)

        return sorted(candidates[:LPM_WINDOW], key=priority) + candidates[LPM_WINDOW:]

    def _has_waited_long(self, request: Request) -> bool:
        """Whether the request arrived ``lpm_aging_steps`` steps ago or more."""
        oldest_fresh_step = self._batch_mirror.num_steps_sent - self.config.lpm_aging_steps
        return self._arrival_step.get(request.request_id, 0) <= oldest_fresh_step

    def _admit(self, request: Request, start: PrefixMatch | SwappedKV) -> None:
        if request.status is RequestStatus.WAITING:  # the first admission: count the lookup, if there is a cache
            request.num_cached_tokens = start.num_tokens
            request.first_scheduled_time = time.monotonic()
            if self.kv.prefix_cache is not None:
                self.num_prefix_query_tokens += request.num_tokens
                self.num_prefix_hit_tokens += start.num_tokens
        request.num_computed_tokens = start.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if is_ready_to_fork(request):  # all but its last prompt token were cached (or it has only one)
            self._fork(request)

    def _match_prefix(self, request: Request) -> PrefixMatch | SwappedKV:
        """Where the request starts: its cached prefix, or its swapped-out KV. One that wants prompt logprobs may
        start only from positions whose logprobs it has returned already (after a preemption): the others' logits
        must be computed; a pooling request that reads every token's hidden state, from none of them."""
        if request.pooling_params is not None and request.pooling_params.pools_every_token(self.pooling_type):
            return self.kv.match_prefix(request, 0)
        wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
        return self.kv.match_prefix(request, request.num_prompt_logprobs_sent if wants_prompt_logprobs else None)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at the back as it arrives, at the front (``front``) as it is preempted or
        parked; under ``priority`` in its rank's place, after those of its rank."""
        if self.config.scheduling_policy == "priority":
            self.waiting.insert_in_order(request, _rank)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _victim(self) -> Request:
        """The running request to preempt: the newest, or under ``priority`` the lowest ranked (of equal ranks, an
        n > 1 request's samples, the newest), as vLLM's v1 chooses."""
        if self.config.scheduling_policy == "priority":
            return max(reversed(self.running), key=_rank)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Preempt a running request and queue it at the front of the waiting queue (in its rank's place under
        ``priority``): by swap, its KV kept in the host tier to resume from; by recompute (or when the host tier
        cannot take it), its KV dropped, to run all its tokens again."""
        if request is self.running[-1]:
            self.running.pop()
        else:
            self.running.remove(request)
        if not (self.config.preemption_mode == "swap" and self.kv.swap_out(request)):
            self.kv.free(request)
            request.num_computed_tokens = 0
        self._batch_mirror.mark_preempted(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    def _take_kv_transfers(self) -> KVTransferPlan:
        return KVTransferPlan(self._fork_copies.take(), *self.kv.take_tier_transfers())

    # ------------------------------------------------------------------------------- update_from_output

    def update_from_output(self, sched_out: SchedulerOutput, model_out: ModelOutput) -> list[EngineOutput]:
        """Advance every scheduled request by its chunk, append sampled tokens, fork n > 1 requests, apply
        stop conditions and free finished requests' blocks. One Python pass over the step's requests.
        Returns one EngineOutput per request that got tokens or prompt logprobs, or finished."""
        outputs: list[EngineOutput] = []
        self._batch_mirror.step_back()
        for row in sched_out.requests:
            request = self.requests.get(row.request_id)
            if request is None:  # finished (e.g. aborted) after this step was scheduled
                continue
            num_emitted = len(model_out.sampled_token_ids.get(row.request_id, ())) if row.draft_token_ids else 0
            # a verified row's KV is valid up to its accepted drafts: its last token + the accepted drafts
            request.num_computed_tokens += num_emitted if row.draft_token_ids else row.num_tokens
            self.kv.cache_computed(request)
            if row.draft_token_ids:  # counted before a finish drops the request's speculation state
                assert self.speculation is not None
                self.speculation.record(request.request_id, len(row.draft_token_ids), num_emitted)
            output = self._take_tokens(request, row, model_out)
            if output is not None:
                outputs.append(output)
            if row.draft_token_ids:
                self._batch_mirror.roll_back_rejected(request)
            if is_ready_to_fork(request):
                self._fork(request)
        return outputs

    def _take_tokens(self, request: Request, row: ScheduledRequest, model_out: ModelOutput) -> EngineOutput | None:
        """Append the row's sampled tokens (if it sampled) and return its output, or None if nothing moved."""
        entries = model_out.prompt_logprobs.get(row.request_id)
        prompt_logprobs = None if entries is None else new_prompt_logprobs(request, row.start_pos, entries)
        new_token_ids: list[int] = []
        logprobs = model_out.logprobs.get(row.request_id)
        if request.pooling_params is not None:
            return self._take_pooled(request, model_out)
        if row.sample:
            if row.request_id not in model_out.sampled_token_ids:
                raise ValueError(f"the model output has no sampled token for request {row.request_id!r}")
            new_token_ids = self._append_tokens(request, model_out.sampled_token_ids[row.request_id])
        if not new_token_ids and prompt_logprobs is None and not request.is_finished:
            return None
        return _engine_output(request, new_token_ids, logprobs, prompt_logprobs)

    def _take_pooled(self, request: Request, model_out: ModelOutput) -> EngineOutput | None:
        """A pooling request whose prompt has run finishes with its pooled hidden states (None: not yet)."""
        if request.num_computed_tokens < request.num_prompt_tokens:
            return None
        pooled = model_out.pooled.get(request.request_id)
        if pooled is None:
            raise ValueError(f"the model output has no pooled states for request {request.request_id!r}")
        self._finish(request, FinishReason.STOP)
        return _engine_output(request, [], None, None, pooled)

    def _fork(self, parent: Request) -> None:
        """Make samples 1..n-1 of ``parent``, whose computed tokens are all but its last prompt token: each runs
        on the parent's KV and runs the last prompt token itself. With no seat left (``max_running``), or
        no block free for its partial-block copy, a sample waits at the head of the queue (``_park_sample``)."""
        parent.has_forked = True
        for index in range(1, parent.sampling_params.n):
            sample = new_sample(parent, index)
            self.requests[sample.request_id] = sample
            self._count_adapter(sample, 1)
            if len(self.running) >= self.config.max_running:
                self._park_sample(parent, sample)
            elif self._fork_copies.share_kv(parent, sample):
                self.running.append(sample)
            else:  # no block for its copy: counted as a preemption, as the swap counters count it among theirs
                self.num_preemptions += 1
                self._park_sample(parent, sample)

    def _park_sample(self, parent: Request, sample: Request) -> None:
        """A sample that cannot run yet waits as if preempted: with swap, on a copy of the parent's KV in the host
        tier (as if swapped out); else (or with no room there) to recompute, from the prefix cache where it is
        on."""
        if not (self.config.preemption_mode == "swap" and self.kv.fork_swapped(parent, sample)):
            sample.num_computed_tokens = 0
        sample.status = RequestStatus.PREEMPTED
        self._enqueue(sample, front=True)

    def _append_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append sampled tokens until one stops the request; returns those appended."""
        appended = []
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            appended.append(token_id)
            stop = stop_reason(request, token_id, self.config.max_model_len)
            if stop is not None:
                self._finish(request, *stop)
                break
        return appended

    def _dequeue(self, request: Request) -> None:
        """Take the request out of the queue it is in, whatever its status says (an interrupt, a SIGINT handler
        that raises inside a step, may have come between a queue change and its status), or of neither (it was
        between them). The waiting queue knows its own in O(1): aborting thousands waiting is not quadratic."""
        if not self.waiting.remove(request) and request in self.running:
            self.running.remove(request)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None,
                commit: bool = True) -> None:
        """``commit``: the request's computed tokens are what completed steps computed (False: its last step was
        abandoned, and what it counts may never have been filled)."""
        # out of the queues and of ``requests`` first: a request is finished once, even should its freeing be
        # interrupted (a second free, from an abort, freed its blocks twice)
        del self.requests[request.request_id]
        self._count_adapter(request, -1)
        self._dequeue(request)
        if commit and request.status is RequestStatus.RUNNING:
            # blocks filled by the drafts accepted in its last step are known only now: into the tree first
            self.kv.cache_computed(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv.free(request)
        self._arrival_step.pop(request.request_id, None)
        self._batch_mirror.mark_finished(request.request_id)
        if self.speculation is not None:
            self.speculation.drop(request.request_id)


def _rank(request: Request) -> tuple[int, float]:
    """A request's place under ``priority``: its priority, then its arrival (an n > 1 request's samples share
    their parent's)."""
    return request.priority, request.arrival_time


def _engine_output(
    request: Request,
    new_token_ids: list[int],
    logprobs: list[TokenLogprobs] | None,
    prompt_logprobs: list[TokenLogprobs] | None,
    pooled: torch.Tensor | None = None,
) -> EngineOutput:
    return EngineOutput(  # positional: keyword arguments double the cost of one output per request per step
        request.request_id,
        new_token_ids,
        request.finish_reason,
        request.stop_reason,
        logprobs[: len(new_token_ids)] if logprobs else None,
        prompt_logprobs,
        request.num_cached_tokens,
        request.first_scheduled_time,
        pooled,
    )
