"""EngineCore: schedule -> execute -> update, plainly or overlapped. No tokenizer and no network: token ids in,
token ids out. Beside the step it keeps the KV pool's peak use (for ``stats``), times steps for the disk tier's
reload costs, and waits briefly on the disk tier's reads when nothing else can run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

from kvserve.kv.groups import NULL_BLOCK
from kvserve.kv.manager import KVCacheManager
from kvserve.outputs import FinishReason
from kvserve.request import Request
from kvserve.sched.output import EngineOutput, KVTransferPlan, ModelOutput, SchedulerOutput
from kvserve.sched.scheduler import Scheduler
from kvserve.worker.model_runner import ModelRunner

DISK_READ_WAIT_SECONDS = 0.05


class PendingStep(NamedTuple):
    """A launched step: what was scheduled, and the call that waits for its model output."""

    sched_out: SchedulerOutput
    model_output: Callable[[], ModelOutput]


PEAK_REMEASURE_SHARE = 0.01  # the waste at peak is measured again once the peak grows by this share of the pool


@dataclass
class KVUsagePeak:
    """Peak KV block use, and the waste (allocated token slots not holding a token) measured at a step within
    ``PEAK_REMEASURE_SHARE`` of the pool below that peak: measuring walks every running request's blocks, which
    at every new peak (every few steps while a large batch decodes) cost as much host time as the step."""

    num_blocks_used: int = 0
    num_blocks_measured: int = 0  # the block use at the step the slots below were counted
    num_slots_allocated: int = 0
    num_slots_used: int = 0

    @property
    def waste(self) -> float:
        return 0.0 if not self.num_slots_allocated else 1 - self.num_slots_used / self.num_slots_allocated


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, kv_manager: KVCacheManager) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.peak = KVUsagePeak()
        # called with each step as its tokens come back, before the update (``bench.step_trace``)
        self.step_observer: Callable[[SchedulerOutput], None] | None = None
        # with a disk tier, what recomputing a prefix costs is measured (``reload_costs``) from each step's period:
        # from the last step's tokens coming back, or from the launch of the first step after an idle engine
        store = kv_manager.store
        self._times_steps = store is not None and store.disk is not None
        self._last_step_back: float | None = None
        self._steps_out: list[SchedulerOutput] = []  # scheduled, their tokens not back yet: oldest first

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> None:
        self.scheduler.finish_requests(request_ids, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        sched_out = self._schedule(self.scheduler.schedule())
        self._start_period()
        return self._update(sched_out, self.runner.execute(sched_out))

    def launch_step(self) -> PendingStep:
        """``step`` in two halves: schedule and queue the step on the device (``ModelRunner.launch``); then
        ``finish_step`` waits for its tokens and updates the scheduler. The host is free in between (on CUDA)."""
        sched_out = self._schedule(self.scheduler.schedule())
        self._start_period()
        return PendingStep(sched_out, self.runner.launch(sched_out))

    def launch_continuation(self, pending: PendingStep) -> PendingStep | None:
        """The step after ``pending``, scheduled and queued before ``pending``'s tokens are read back, so that the
        device never waits for the host between the two (``Scheduler.schedule_continuation``; the runner takes
        its input ids from ``pending``'s sampled tokens on the device). None where it cannot be: then the
        next step is scheduled after ``finish_step(pending)``, as usual."""
        if not self.runner.can_continue(pending.sched_out):
            return None
        sched_out = self.scheduler.schedule_continuation(pending.sched_out)
        if sched_out is None:
            return None
        return PendingStep(self._schedule(sched_out), self.runner.launch(sched_out))

    def finish_step(self, pending: PendingStep) -> list[EngineOutput]:
        """Read back ``pending``'s tokens and update; then a continued step launched after it whose draw waited
        for those tokens (a grammar's row) is drawn, so that its tokens are on the device for the next launch."""
        outputs = self._update(pending.sched_out, pending.model_output())
        self.runner.draw_deferred()
        return outputs

    def abandon_steps(self) -> None:
        """A step raised (in the runner, as its tokens were read back, or while it was scheduled): the steps not
        back yet are abandoned and every request finishes, committing nothing (``Scheduler.abandon``), with the
        KV moves planned and never applied, and the runner's tokens in flight and draws waiting. The scheduler,
        the KV cache and the runner are then as if those requests had never come, so the engine can go on."""
        self.scheduler.abandon(self._steps_out)
        self._steps_out.clear()
        self.kv_manager.abandon_transfers()
        self.runner.abandon_steps()
        self._last_step_back = None

    def _schedule(self, sched_out: SchedulerOutput) -> SchedulerOutput:
        """A step just scheduled: out until its update."""
        self._steps_out.append(sched_out)
        self._track_peak(sched_out)
        return sched_out

    def _update(self, sched_out: SchedulerOutput, model_out: ModelOutput) -> list[EngineOutput]:
        back = self._steps_out.pop(0)
        assert back is sched_out, "steps come back in the order they were scheduled"
        if self.step_observer is not None:
            self.step_observer(sched_out)
        store = self.kv_manager.store
        step_back = time.perf_counter() if self._times_steps else 0.0
        if self._times_steps:
            self._observe_step_cost(sched_out, step_back)
        if sched_out.is_empty and store is not None and store.num_reading:
            store.wait_for_reads(DISK_READ_WAIT_SECONDS)  # only requests waiting on the disk: don't spin
        outputs = self.scheduler.update_from_output(sched_out, model_out)
        if self._times_steps:  # idle after this step: the next period starts at its launch
            self._last_step_back = step_back if self.scheduler.has_unfinished_requests() else None
        if store is not None and not self.scheduler.has_unfinished_requests():
            self.offload_pending()  # idle now: the last step's blocks go to the tiers without waiting for a step
        return outputs

    def _start_period(self) -> None:
        """A step's period runs from the last step's tokens coming back; after an idle engine, from its launch."""
        if self._times_steps and self._last_step_back is None:
            self._last_step_back = time.perf_counter()

    def _observe_step_cost(self, sched_out: SchedulerOutput, step_back: float) -> None:
        """Feed the KV manager's reload costs with this step's period (to ``step_back``, its tokens coming back)
        and how much of it was prefill: what recomputing a prefix costs."""
        if self._last_step_back is not None and not sched_out.is_empty:
            prefill = sum(r.num_tokens for r in sched_out.requests if not r.is_decode)
            self.kv_manager.reload_costs.observe_step(prefill, sched_out.num_tokens, step_back - self._last_step_back)

    def offload_pending(self) -> None:
        """Apply the tier offloads planned since the last step (blocks computed in it) at once."""
        offloads, *moves_in_a_step = self.kv_manager.take_tier_transfers()
        assert not any(moves_in_a_step), "loads and swaps are planned only while scheduling, and sent with that step"
        self.runner.apply_kv_transfers(KVTransferPlan(offloads=offloads))  # their disk writes queued once copied

    def _track_peak(self, sched_out: SchedulerOutput) -> None:
        num_used = self.kv_manager.num_blocks_total - self.kv_manager.num_free_blocks()
        if num_used <= self.peak.num_blocks_used:
            return
        self.peak.num_blocks_used = num_used
        remeasure_at = self.peak.num_blocks_measured + PEAK_REMEASURE_SHARE * self.kv_manager.num_blocks_total
        if self.peak.num_blocks_measured and num_used < remeasure_at:
            return
        block_size = self.kv_manager.block_size
        filled: dict[int, int] = {}  # block -> token slots in use; a block shared by prefix or fork counts once
        requests = self.scheduler.requests
        for r in sched_out.requests:
            num_tokens = r.start_pos + r.num_tokens
            for table in self.kv_manager.tables(requests[r.request_id]):
                for index, block_id in enumerate(table):
                    if block_id != NULL_BLOCK:
                        num_in_block = min(block_size, max(0, num_tokens - index * block_size))
                        filled[block_id] = max(filled.get(block_id, 0), num_in_block)
        self.peak = KVUsagePeak(num_used, num_used, len(filled) * block_size, sum(filled.values()))
