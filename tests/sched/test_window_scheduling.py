"""The scheduler over KV cache groups that free sliding-window blocks, against a model-free runner that mirrors
every group's table from the step diffs alone and keeps a fake cache of token ids: every key a query can see
must still hold its token in its group's blocks (a block freed too early is reused and overwritten), no request
writes a block another holds, the pool and the tables agree after every step, and nothing is left held once
every request finished or was aborted."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.kv.groups import NULL_BLOCK, KVCacheGroups
from kvserve.kv.manager import KVCacheManager
from kvserve.outputs import FinishReason
from kvserve.sched.output import ModelOutput, ScheduledRequest, SchedulerOutput
from kvserve.sched.scheduler import Scheduler
from tests.sched.sched_fakes import default_token, make_request, shared_prefix


class GroupedFakeRunner:
    """The runner's view: per request, its tokens and every group's table, from the diffs alone."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.windows = kv.groups.windows
        self.block_size = kv.block_size
        self.ref_count = kv.pool.ref_count
        self.cache: list[list[int | None]] = [[None] * kv.block_size for _ in range(kv.num_blocks_total)]
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
        for src, dst in sched_out.kv_transfers.copies:
            self.cache[dst] = list(self.cache[src])
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
        for window, table in zip(self.windows, self.tables[row.request_id]):
            first_visible = 0 if window is None else max(0, start - window + 1)
            assert NULL_BLOCK not in table[first_visible // size :], f"{row.request_id}: a visible block is null"
            for pos in range(first_visible, start):
                block, offset = divmod(pos, size)
                assert self.cache[table[block]][offset] == history[pos], f"{row.request_id}: stale KV at {pos}"
            for pos in range(start, end):
                block, offset = divmod(pos, size)
                assert self.ref_count(table[block]) <= 1, f"{row.request_id} writes a shared block"
                self.cache[table[block]][offset] = history[pos]
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
    st.randoms(use_true_random=False),
)
def test_window_groups_keep_what_queries_see_and_leak_nothing(
    specs: list[tuple[int, int, int, bool]], layout: str, window: int, num_blocks: int, chunk: int,
    prefix_caching: bool, rng
) -> None:
    """With the prefix cache (where a full group keys it), prompts share prefixes: hits take every group's
    cached blocks, evictions of window blocks cut matches, and the runner still finds every visible key."""
    block_size = 4
    groups = LAYOUTS[layout](window)
    prefix_caching = prefix_caching and groups.keys_prefix_tree
    kv = KVCacheManager(num_blocks, block_size, prefix_caching, groups=groups)
    scheduler = Scheduler(SchedulerConfig(4, chunk, 80), kv)
    runner = GroupedFakeRunner(kv)
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
            break
        sched_out = scheduler.schedule()
        scheduler.update_from_output(sched_out, runner.execute(sched_out))
        kv.check_integrity(scheduler.requests.values())
        runner.check_mirrors(scheduler)
    else:
        raise AssertionError("the workload did not finish")
    assert kv.num_free_blocks() == num_blocks and kv.num_windowed_blocks == 0
    assert kv.pool.num_evictable_blocks == kv.num_cached_blocks  # what the tree keeps, none held
    kv.check_integrity([])
    widest = max(w for w in groups.windows if w is not None)
    assert runner.max_window_blocks <= (widest - 1 + chunk) // block_size + 2


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
