"""The scheduler over KV cache groups that free sliding-window blocks, against a model-free runner that mirrors
every group's table from the step diffs alone and keeps a fake cache of token ids, each group's distinct: every
key a query can see must still hold its token in its group's blocks (a block freed too early is reused and
overwritten, a block swapped or offloaded in and loaded back into the wrong group or place is caught), no
request writes a block another holds, the pool and the tables agree after every step, and nothing is left held
once every request finished or was aborted. With a host tier (and a disk tier) under the pool, evicted blocks of
every group go there and come back on hits, and preemption may swap."""

from __future__ import annotations

import random
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.kv.groups import NULL_BLOCK, KVCacheGroups
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.tiers import TieredStore
from kvserve.outputs import FinishReason
from kvserve.sched.output import ModelOutput, ScheduledRequest, SchedulerOutput
from kvserve.sched.scheduler import Scheduler
from tests.sched.sched_fakes import (
    TransferCounts,
    apply_kv_transfers,
    default_token,
    fake_tiers,
    group_kv,
    make_request,
    shared_prefix,
)


class GroupedFakeRunner:
    """The runner's view: per request, its tokens and every group's table, from the diffs alone."""

    def __init__(self, kv: KVCacheManager, tiers: TieredStore | None = None) -> None:
        self.windows = kv.groups.windows
        self.block_size = kv.block_size
        self.ref_count = kv.pool.ref_count
        self.cache: list[list[int | None]] = [[None] * kv.block_size for _ in range(kv.num_blocks_total)]
        self.tiers = tiers
        self.moved = TransferCounts()
        self.tables: dict[str, list[list[int]]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.max_window_blocks = 0  # the most blocks one request held in a window group at once

    def execute(self, sched_out: SchedulerOutput) -> ModelOutput:
        for request_id in sched_out.finished_request_ids | sched_out.preempted_request_ids:
            self.tables.pop(request_id, None)
        num_groups = len(self.windows)
        for new in sched_out.new_requests:
            n = len(new.block_ids) // num_groups
            self.tables[new.request_id] = [list(new.block_ids[g * n : (g + 1) * n]) for g in range(num_groups)]
            self.prompts[new.request_id] = list(new.prompt_token_ids)
            self.outputs[new.request_id] = list(new.output_token_ids)
        apply_kv_transfers(self.cache, self.tiers, sched_out.kv_transfers, self.moved)
        sampled = {}
        for row in sched_out.requests:
            self._apply_diff(row)
            self._check_and_write(row)
            if row.sample:
                token = default_token(row.request_id, len(self.outputs[row.request_id]))
                self.outputs[row.request_id].append(token)
                sampled[row.request_id] = [token]
        return ModelOutput(sampled)

    def _apply_diff(self, row: ScheduledRequest) -> None:
        tables = self.tables[row.request_id]
        n = len(row.new_block_ids) // len(tables)
        for g, table in enumerate(tables):
            table.extend(row.new_block_ids[g * n : (g + 1) * n])
        for table, num_null in zip(tables, row.num_null_blocks):
            table[:num_null] = [NULL_BLOCK] * num_null

    def _check_and_write(self, row: ScheduledRequest) -> None:
        history = self.prompts[row.request_id] + self.outputs[row.request_id]
        start, end = row.start_pos, row.start_pos + row.num_tokens
        size = self.block_size
        for group, (window, table) in enumerate(zip(self.windows, self.tables[row.request_id])):
            first_visible = 0 if window is None else max(0, start - window + 1)
            assert NULL_BLOCK not in table[first_visible // size :], f"{row.request_id}: a visible block is null"
            kv = [group_kv(group, token) for token in history]
            for pos in range(first_visible, start):
                block, offset = divmod(pos, size)
                assert self.cache[table[block]][offset] == kv[pos], f"{row.request_id}: stale KV at {pos}"
            for pos in range(start, end):
                block, offset = divmod(pos, size)
                assert self.ref_count(table[block]) <= 1, f"{row.request_id} writes a shared block"
                self.cache[table[block]][offset] = kv[pos]
            if window is not None:
                self.max_window_blocks = max(self.max_window_blocks, sum(b != NULL_BLOCK for b in table))

    def check_mirrors(self, scheduler: Scheduler) -> None:
        for request_id, tables in self.tables.items():
            request = scheduler.requests.get(request_id)
            if request is not None:
                assert tables == scheduler.kv.tables(request), request_id


LAYOUTS = {
    "gemma3": lambda w: KVCacheGroups.of_layers([w, None]),
    "mistral": lambda w: KVCacheGroups.of_layers([w, w]),
    "two windows": lambda w: KVCacheGroups.of_layers([w, None, 2 * w, w, None, 2 * w]),
}


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 24), st.sampled_from([1, 1, 2, 3]), st.booleans()),
             min_size=1, max_size=10),
    st.sampled_from(sorted(LAYOUTS)),
    st.integers(2, 9),
    st.integers(10, 60),
    st.sampled_from([4, 8, 32]),
    st.booleans(),
    st.sampled_from(["recompute", "swap"]),
    st.none() | st.integers(1, 40),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_window_groups_keep_what_queries_see_and_leak_nothing(
    specs: list[tuple[int, int, int, bool]], layout: str, window: int, num_blocks: int, chunk: int,
    prefix_caching: bool, preemption_mode: str, host_blocks: int | None, with_disk: bool, seed: int
) -> None:
    """With the prefix cache (where a full group keys it), prompts share prefixes: hits take every group's
    cached blocks, evictions of window blocks cut matches, and the runner still finds every visible key. With
    ``host_blocks``, a host tier (and with ``with_disk`` a disk tier) takes every group's evicted blocks and
    gives them back on hits, and preemption by swap keeps each group's live blocks in its rows."""
    block_size = 4
    groups = LAYOUTS[layout](window)
    prefix_caching = prefix_caching and groups.keys_prefix_tree
    swaps = preemption_mode == "swap" and host_blocks is not None
    uses_tiers = host_blocks is not None and (prefix_caching or swaps)
    with tempfile.TemporaryDirectory() as disk_dir:
        disk = disk_dir if with_disk and prefix_caching else None
        tiers = fake_tiers(block_size, host_blocks, disk, groups.layout) if uses_tiers else None
        kv = KVCacheManager(num_blocks, block_size, prefix_caching, tiers, groups)
        config = SchedulerConfig(4, chunk, 80, preemption_mode="swap" if swaps else "recompute")
        scheduler = Scheduler(config, kv)
        runner = GroupedFakeRunner(kv, tiers)
        try:
            # the workload's draws come from a seed, not from hypothesis's own random: with a disk tier, when a
            # block's read lands (a reader thread) moves the steps, so how many draws an example makes varies
            # from run to run, which hypothesis reports as a flaky strategy
            _run_random_workload(scheduler, runner, specs, random.Random(seed))
        finally:  # hypothesis may stop an example that draws too much: its I/O threads end before the directory
            if tiers is not None:
                tiers.close()
    assert kv.num_free_blocks() == num_blocks and kv.num_windowed_blocks == 0
    assert kv.pool.num_evictable_blocks == kv.num_cached_blocks  # what the tree keeps, none held
    kv.check_integrity([])
    widest = max(w for w in groups.windows if w is not None)
    assert runner.max_window_blocks <= (widest - 1 + chunk) // block_size + 2
    if tiers is not None:
        assert tiers.counters.blocks_loaded == runner.moved.num_loads
        assert not tiers.host._pins, "a pinned host block outlived its load or write"
        assert kv.swap.counters.num_blocks_swapped_in == runner.moved.num_swapped_in
        kv.take_tier_transfers()  # rows go back at the plan after their last copy
        assert len(tiers.host._free) + tiers.host.num_blocks == tiers.host.num_rows, "a swapped-out host row leaked"


def _run_random_workload(scheduler: Scheduler, runner: GroupedFakeRunner, specs: list[tuple[int, int, int, bool]],
                         rng) -> None:
    """Requests of ``specs`` (prompt length, max_tokens, n, shares a prefix) added, aborted now and then, and
    stepped to the end, checking the manager and the runner's tables after every step."""
    pending = [make_request(f"r{i}", p, max_tokens=m, n=n, prefix=shared_prefix(i % 2, min(p, 24)) if shared else [])
               for i, (p, m, n, shared) in enumerate(specs)]
    for _ in range(2000):
        if pending and rng.random() < 0.4:
            try:
                scheduler.add_request(pending.pop())
            except ValueError:  # could never fit: refused, nothing queued
                pass
        if scheduler.requests and rng.random() < 0.05:
            scheduler.finish_requests([rng.choice(sorted(scheduler.requests))], FinishReason.ABORT)
        if not pending and not scheduler.has_unfinished_requests():
            return
        _step(scheduler, runner)
    raise AssertionError("the workload did not finish")


def _step(scheduler: Scheduler, runner: GroupedFakeRunner) -> None:
    """One engine step (waiting a little for disk reads when only requests waiting on them are left), checking
    the manager and the runner's tables after it."""
    sched_out = scheduler.schedule()
    scheduler.update_from_output(sched_out, runner.execute(sched_out))
    store = scheduler.kv.store
    if sched_out.is_empty and store is not None and store.num_reading:
        store.wait_for_reads(0.05)
    scheduler.kv.check_integrity(scheduler.requests.values())
    runner.check_mirrors(scheduler)


def _finish_all(scheduler: Scheduler, runner: GroupedFakeRunner) -> None:
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            return
        _step(scheduler, runner)
    raise AssertionError("the requests did not finish")


def _tiered_scheduler(num_blocks: int, disk_dir: str | None, preemption_mode: str = "recompute",
                      prefix_caching: bool = True) -> tuple[Scheduler, GroupedFakeRunner]:
    groups = KVCacheGroups.of_layers([6, None])
    kv = KVCacheManager(num_blocks, 4, prefix_caching, fake_tiers(4, 64, disk_dir, groups.layout), groups)
    scheduler = Scheduler(SchedulerConfig(2, 8, 256, preemption_mode=preemption_mode), kv)
    return scheduler, GroupedFakeRunner(kv, kv.store)


def test_conversations_find_their_evicted_history_in_the_tiers_with_the_window_blocks_their_queries_see(
    tmp_path,
) -> None:
    """Three conversations taking turns over a pool too small for their histories together: each turn finds its
    history evicted to the host tier, every group's blocks of it, and a restarted scheduler finds it on disk."""
    scheduler, runner = _tiered_scheduler(24, str(tmp_path))
    prompts = []
    for turn in range(3):
        for conversation in range(3):
            request_id = f"c{conversation}t{turn}"
            earlier = f"c{conversation}t{turn - 1}"
            history = prompts[-3] + runner.outputs[earlier] if turn else []
            request = make_request(request_id, len(history) + 10, prefix=history, max_tokens=6)
            prompts.append(request.prompt_token_ids)
            scheduler.add_request(request)
            _finish_all(scheduler, runner)
    tiers = scheduler.kv.store
    loaded_tokens = tiers.counters.blocks_loaded * 4
    assert 0 < tiers.counters.host_hit_tokens < loaded_tokens  # window blocks loaded too, adding no hit tokens
    assert runner.max_window_blocks <= (6 - 1 + 8) // 4 + 2
    tiers.flush()
    restarted, runner = _tiered_scheduler(24, str(tmp_path))
    for index, prompt in enumerate(prompts):
        restarted.add_request(make_request(f"again{index}", len(prompt), prefix=prompt, max_tokens=2))
        _finish_all(restarted, runner)
    # every prompt starts from all its whole blocks but the last token's: the first time off the disk
    assert restarted.num_prefix_hit_tokens == sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert restarted.kv.store.counters.disk_hit_tokens >= sum((len(p) - 1) // 4 * 4 for p in prompts[:3])
    assert restarted.kv.store.counters.corrupt_blocks == 0


def test_swap_preemption_moves_every_groups_live_blocks_out_and_back() -> None:
    scheduler, runner = _tiered_scheduler(20, None, preemption_mode="swap", prefix_caching=False)
    for request_id in ("a", "b"):
        scheduler.add_request(make_request(request_id, 30, max_tokens=20))
    _finish_all(scheduler, runner)
    swap = scheduler.kv.swap.counters
    assert scheduler.num_preemptions > 0 and swap.num_swapped_out == swap.num_swapped_in == scheduler.num_preemptions
    assert swap.num_blocks_swapped_in == runner.moved.num_swapped_in == runner.moved.num_swapped_out
    # a swap of n <= 49 computed tokens keeps ceil(n / 4) blocks of the full group, 2 or 3 of the window group
    assert swap.num_blocks_swapped_out <= swap.num_swapped_out * (-(-49 // 4) + 3)
    assert scheduler.kv.num_free_blocks() == 20 and runner.max_window_blocks <= (6 - 1 + 8) // 4 + 2


def test_a_long_decode_holds_a_bounded_number_of_window_blocks() -> None:
    kv = KVCacheManager(64, 4, groups=KVCacheGroups.of_layers([6, None]))
    scheduler = Scheduler(SchedulerConfig(4, 16, 256), kv)
    runner = GroupedFakeRunner(kv)
    scheduler.add_request(make_request("r", 30, max_tokens=150))
    held = []
    while scheduler.has_unfinished_requests():
        sched_out = scheduler.schedule()
        scheduler.update_from_output(sched_out, runner.execute(sched_out))
        kv.check_integrity(scheduler.requests.values())
        held.append(kv.num_windowed_blocks)
    assert max(held[5:-1]) <= 3 and len(held) > 150  # (6 - 1 + 1) / 4 blocks, +1 across a boundary
    assert kv.num_free_blocks() == 64
