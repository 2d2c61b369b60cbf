"""KVCacheManager: the scheduler's only view of KV memory.

It owns the block pool and every request's block table (``request.block_ids``); nobody else allocates or frees
blocks. Blocks stay opaque ints to the scheduler. It allocates, forks, swaps and matches itself, and keeps the
rest in parts it owns::

    paths       CachePaths (kv/cache_paths.py)   each request's path on the prefix tree; group blocks beside nodes
    tier_plan   TierPlan (kv/tier_plan.py)       the tier offloads and loads planned for the next step
    swap        SwapSpace (kv/swap.py)           swapped-out requests' host rows, swap-outs and swap-ins planned
    (matches)   TierMatcher (kv/tier_match.py)   prefix matches continued below the device, through the tiers

A request preempted by swap (``swap_out``) leaves its KV in host rows (``kv/swap.py``) and holds no block;
its next ``match_prefix`` is that KV (a ``SwappedKV``, not a ``PrefixMatch``), and ``allocate_slots`` from it
takes back the leading blocks the tree still holds on the device and loads the rest into fresh blocks.

With KV cache groups that free blocks (``kv/groups.py``: sliding-window layers), a request has one table per
group (``request.block_ids`` for group 0, ``request.group_block_ids`` for the others), all as long. Before a
step, a window group's blocks wholly before the window of the step's first query are freed and their entries
become ``NULL_BLOCK``; the step writes and reads nothing there, and no later query sees them::

    window w = 6, block_size 4, the step's first query at position 13 sees keys 8 .. 13:
    full group:    | b0 | b1 | b2 | b3 |
    window group:  | -1 | -1 | b6 | b7 |      blocks (13 - 6 + 1) // 4 = 2 of them dead, freed

The prefix tree stays keyed by group 0, the model's one full-attention group (``KVCacheGroups.keys_prefix_tree``;
a model with no full group, or several, gets the plain layout from the engine when the prefix cache is on), the
other groups' blocks of a node's tokens cached beside it, where they may be evicted alone (``kv/cache_paths.py``).
A match of k blocks lets a request compute from position k * block_size, whose query sees the keys from
k * block_size - w + 1 on, so it is valid only if every window group still has the blocks of those positions::

    match of k = 4 blocks (block_size 4, w = 6): the query at 16 sees 11 .. 16, blocks 2 and 3
    full group:    | b0 | b1 | b2 | b3 |
    window group:  |  . |  . | b6 | b7 |     '.': evicted or never needed; b6 or b7 evicted: shorten the match

and is shortened to the longest k that is (``KVCacheGroups.visible_length``). The request's window tables then
start with nulls up to the first needed block.

With the KV tiers, a match through the tiers walks group 0's keys past the device tree, then is shortened as above,
a window block counting as there if it is beside its node or in the host tier (loaded into a fresh block, under its
group's key: ``kv/tier_plan.py``); blocks on the disk that a longer match would need are read while the request
waits. A swap keeps every group's blocks that the request's next query sees, none of a window group's dead ones,
and brings them back with nulls before them.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

from kvserve.kv.block_keys import group_key
from kvserve.kv.block_pool import BlockPool, NoFreeBlocksError
from kvserve.kv.cache_paths import CachePaths
from kvserve.kv.groups import NULL_BLOCK, KVCacheGroups
from kvserve.kv.prefix_cache import PrefixCache, PrefixMatch, PrefixNode
from kvserve.kv.reload_costs import ReloadCosts
from kvserve.kv.swap import SwappedKV, SwapSpace
from kvserve.kv.tier_match import TierMatcher
from kvserve.kv.tier_plan import TierPlan
from kvserve.kv.tiers import TieredStore
from kvserve.request import Request


class KVCacheManager:
    cache_computed: Callable[[Request], None]
    """After a step: the request's blocks now computed stop being pending, and blocks it has just filled with known
    tokens (outputs) join the tree. It is ``CachePaths.cache_computed`` itself, bound in ``__init__``: the scheduler
    calls it for every request every step, and a method here passing it on would add a call to each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 store: TieredStore | None = None, groups: KVCacheGroups | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if store is not None and store.disk is not None and not enable_prefix_caching:
            raise ValueError("a disk tier keeps prefix-cache blocks: it needs prefix caching on")
        self.groups = groups or KVCacheGroups.single(1)
        self._has_group_tables = self.groups.frees_blocks  # a table per group, windows' dead blocks freed
        if store is not None and store.format.kv_layout != self.groups.layout:
            raise ValueError(f"the KV tiers keep blocks of layout {store.format.kv_layout!r}, the cache's groups are "
                             f"{self.groups.layout!r}")
        if self._has_group_tables and enable_prefix_caching and not self.groups.keys_prefix_tree:
            raise ValueError("the prefix cache with KV cache groups needs one full-attention group to key its tree: "
                             "use KVCacheGroups.single")
        self.num_windowed_blocks = 0  # distinct blocks held in window groups' tables
        self._null_counts: dict[str, tuple[int, ...]] = {}  # per request: leading null entries per group, if new
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None
        self.store = store
        self.swap = SwapSpace(store) if store is not None else None
        self.tier_plan = TierPlan(store) if store is not None else None
        self.paths = CachePaths(self.pool, block_size, self.prefix_cache, self.tier_plan)
        self.pool.on_evict = self.paths.on_evict  # an evicted block leaves the tree (and goes to the tiers)
        self.cache_computed = self.paths.cache_computed
        self._matches: dict[str, PrefixMatch] = {}  # waiting requests' last prefix match, extended as the tree grows
        self.reload_costs = ReloadCosts()  # disk reads against recomputing, as measured (the engine feeds it)
        self._tier_matcher = (TierMatcher(store, self.prefix_cache, self.groups, block_size, self.reload_costs)
                              if store is not None and self.prefix_cache is not None else None)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache names (held or evictable), every group's."""
        return self.paths.num_cached_blocks

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted to make room, since start."""
        return self.paths.num_evictions

    @property
    def num_blocks_total(self) -> int:
        return self.pool.num_blocks

    @property
    def num_slots_total(self) -> int:
        """The pool's token slots: the most tokens the whole cache holds in the plain layout (with KV cache
        groups a token takes a slot in each group it is kept in)."""
        return self.pool.num_blocks * self.block_size

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """The fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, request: Request, max_cached_tokens: int | None = None) -> PrefixMatch | SwappedKV:
        """Where a request holding no blocks can start: the longest computed cached prefix of its tokens, of at
        most ``max_cached_tokens`` tokens, leaving at least one token to compute (its logits are needed); empty
        when caching is off. The match is remembered until the request takes blocks or is freed, so that matching
        a waiting request again costs O(1) while the tree does not change under it. A swapped-out request starts
        from its own KV instead (``SwappedKV``), all its computed tokens, whatever ``max_cached_tokens`` (their
        prompt logprobs are returned)."""
        if self.swap is not None and request.request_id in self.swap:
            return self.swap.resume_point(request.request_id)
        if self.prefix_cache is None:
            return PrefixMatch((), self.block_size)
        max_tokens = request.num_tokens - 1
        if max_cached_tokens is not None:
            max_tokens = min(max_tokens, max_cached_tokens)
        earlier = self._matches.get(request.request_id)
        max_blocks = max_tokens // self.block_size
        match = self.prefix_cache.match(request.token_ids, max_blocks, earlier, request.cache_namespace)
        self._matches[request.request_id] = match
        if (self._tier_matcher is not None and not match.sibling_computing
                and (self._has_group_tables or len(match.nodes) < max_blocks)):
            return self._tier_matcher.extend(request, match, max_blocks)
        return self._visible_match(match) if self._has_group_tables else match

    def _visible_match(self, match: PrefixMatch) -> PrefixMatch:
        """The longest prefix of a device match after which every window group still has, beside its nodes, the
        blocks the next query sees (module docstring)."""
        nodes = match.nodes
        k = self.groups.visible_length(len(nodes), self.block_size,
                                       lambda g, index: nodes[index].group_block_ids[g - 1] != NULL_BLOCK)
        return match if k == len(nodes) else PrefixMatch(nodes[:k], self.block_size)

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache of every block no request holds (vLLM's ``reset_prefix_cache``); returns how many
        blocks it let go of. Blocks running requests hold stay cached (``num_cached_blocks`` counts them): their
        paths run through them, and they are evictable once released. The KV tiers are left as they are
        (``TieredStore.clear`` empties them)."""
        if self.prefix_cache is None:
            return 0
        num_cached = self.num_cached_blocks
        self.paths.drop_unheld()
        self._matches.clear()  # waiting requests match again from the root
        return num_cached - self.num_cached_blocks

    def drop_planned_offloads(self) -> None:
        """Forget the tier offloads planned since the last step (sleep mode: the blocks' memory is about to go)."""
        if self.tier_plan is not None:
            self.tier_plan.drop_offloads()

    def clear_tiers(self) -> int:
        """Empty the KV tiers of what nothing waits for (``TieredStore.clear``), and drop the offloads planned
        since the last step, which would fill them again; returns how many tier blocks were dropped (0 without
        tiers)."""
        if self.store is None:
            return 0
        self.drop_planned_offloads()
        return self.store.clear()

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       start: PrefixMatch | SwappedKV | None = None) -> bool:
        """Grow the request's block tables so that its computed tokens plus ``num_new_tokens`` fit; ``start``,
        for a request holding no blocks, is where ``match_prefix`` said it starts: a cached prefix, or its
        swapped-out KV (the caller then counts ``start.num_tokens`` as computed).

        All or nothing: returns False and changes nothing when the pool cannot supply the blocks::

            block_ids:  | b0 ......... | b1 ......... | b2 ...       | (new) ...    |
            tokens:     |<--- num_computed_tokens --->|<-- num_new_tokens -->|
                                                      ^ start of this step's chunk
            blocks needed = ceil((num_computed_tokens + num_new_tokens) / block_size) - len(block_ids)

        (every group's table, the same number each; window groups first drop the blocks no query from the
        step's first on sees, which is no change worth undoing if it then returns False).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if isinstance(start, SwappedKV):
            return self._swap_in(request, start, num_new_tokens)
        if start is not None and (start.nodes or start.tiered):
            if request.block_ids:
                raise ValueError(f"request {request.request_id} holds blocks; only a fresh one takes a prefix")
            return self._take_match(request, num_new_tokens, start)
        num_computed = request.num_computed_tokens
        if not self._has_group_tables and self.num_blocks_for(num_computed + num_new_tokens) <= len(request.block_ids):
            self.paths.extend(request, num_computed)  # the common decode step: its blocks hold the new tokens
            return True
        if not request.block_ids:
            request.group_block_ids = [[] for _ in range(self.groups.num_groups - 1)]
        tables = self.tables(request)
        self._drop_dead_blocks(request, tables, num_computed)
        num_needed = max(0, self.num_blocks_for(num_computed + num_new_tokens) - len(tables[0]))
        if num_needed * len(tables) > self.pool.num_free_blocks:
            return False
        self._forget_match(request)
        self._fill(tables, [], num_needed)
        self.paths.extend(request, num_computed)
        return True

    def tables(self, request: Request) -> list[list[int]]:
        """The request's block table of every group, group 0 first."""
        return [request.block_ids, *request.group_block_ids]

    def take_null_counts(self, request: Request) -> tuple[int, ...]:
        """Per group, how many leading entries of the request's table are ``NULL_BLOCK`` now, if that grew since
        the last call (else ()): the runner nulls them in its copy."""
        return self._null_counts.pop(request.request_id, ())

    def max_blocks_for(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens ever holds at once, run in chunks of at most
        ``max_chunk`` tokens: a full group every block, a window group those of its window plus a chunk."""
        num_blocks = self.num_blocks_for(num_tokens)
        if not self._has_group_tables:
            return num_blocks
        return sum(num_blocks if w is None else min(num_blocks, (w - 1 + max_chunk) // self.block_size + 2)
                   for w in self.groups.windows)

    def _take_match(self, request: Request, num_new_tokens: int, prefix: PrefixMatch) -> bool:
        """``allocate_slots`` for a fresh request starting from a prefix match: the device blocks of every group
        taken, fresh blocks loaded from the host tier for the rest of the match (pinned there until the load),
        then blocks for the new tokens; False, changing nothing, if the pool lacks blocks or a block to load
        left the host tier since the match."""
        num_computed = prefix.num_tokens
        tables, loads = self._match_tables(prefix)
        num_needed = max(0, self.num_blocks_for(num_computed + num_new_tokens) - len(tables[0]))
        cached = [b for table in tables for b in table if b != NULL_BLOCK]
        num_revived = sum(1 for b in cached if self.pool.ref_count(b) == 0)  # hits on evictable blocks
        if num_needed * len(tables) + len(loads) + num_revived > self.pool.num_free_blocks:
            return False
        keys = [key for _, _, key in loads]
        if keys:
            assert self.store is not None
            if not self.store.pin(keys):  # one left the host tier since the match: match again
                return False
        self._forget_match(request)
        self._hold(tables)  # first, so that the allocation below cannot evict them
        # the request owns its tables before they are filled, so that an interrupt (a caller's SIGINT handler
        # that raises) while blocks are allocated into them leaves them where ``free`` finds them
        request.block_ids, request.group_block_ids = tables[0], tables[1:]
        fresh = self._fill(tables, [(group, index) for group, index, _ in loads], num_needed)
        if keys:
            assert self.tier_plan is not None
            self.tier_plan.add_loads(zip(keys, fresh))
        # the blocks to load join the tree pending, as a swap-in's do: computed once their step is back, never
        # before their copy (a step that raises first leaves no node over a block that was never filled)
        self.paths.start(request, prefix.nodes, len(prefix.nodes) * self.block_size)
        return True

    def _match_tables(self, match: PrefixMatch) -> tuple[list[list[int]], list[tuple[int, int, bytes]]]:
        """Every group's table of a match, and the (group, index, content key) of its entries to load from the
        host tier (``NULL_BLOCK`` until filled): group 0's nodes, then its tiered blocks; a window group's from
        the first block its next query sees, the blocks beside the nodes where still there, else loads."""
        nodes = match.nodes
        tables = [[node.block_id for node in nodes] + [NULL_BLOCK] * len(match.tiered)]
        loads = [(0, len(nodes) + i, key) for i, key in enumerate(match.tiered)]
        num_blocks = len(tables[0])
        keys = [node.content_key for node in nodes] + list(match.tiered)
        for group in range(1, self.groups.num_groups):
            first = self.groups.first_visible_block(group, num_blocks * self.block_size, self.block_size)
            table = [nodes[i].group_block_ids[group - 1] if i < len(nodes) else NULL_BLOCK for i in range(num_blocks)]
            table[:first] = [NULL_BLOCK] * first
            for index in range(first, num_blocks):
                if table[index] == NULL_BLOCK:
                    key = keys[index]
                    assert key is not None, "a match lost a block its query would see"
                    loads.append((group, index, group_key(key, group)))
            tables.append(table)
        return tables, loads

    def _hold(self, tables: list[list[int]]) -> None:
        """Add the request as a holder of every cached block its new tables name, counting the window groups'
        blocks that were unheld."""
        for window, table in zip(self.groups.windows, tables):
            live = [b for b in table if b != NULL_BLOCK]
            if window is not None:
                self.num_windowed_blocks += sum(1 for b in live if self.pool.ref_count(b) == 0)
            self.pool.take(live)

    def _fill(self, tables: list[list[int]], slots: list[tuple[int, int]], num_new_blocks: int) -> list[int]:
        """Fresh blocks into the entries ``slots`` ((group, index)) of the tables, then ``num_new_blocks`` more at
        the end of each; returns those put into ``slots``, in order. The caller checked that the pool has them."""
        fresh = self.pool.allocate(len(slots))
        for (group, index), block_id in zip(slots, fresh):
            tables[group][index] = block_id
        for table in tables:
            table.extend(self.pool.allocate(num_new_blocks))
        windowed = [w is not None for w in self.groups.windows]
        self.num_windowed_blocks += sum(windowed[group] for group, _ in slots) + num_new_blocks * sum(windowed)
        return fresh

    def _forget_match(self, request: Request) -> None:
        self._matches.pop(request.request_id, None)
        if self._tier_matcher is not None:
            self._tier_matcher.forget(request.request_id)

    def _drop_dead_blocks(self, request: Request, tables: list[list[int]], num_computed: int) -> None:
        """Free the window groups' blocks wholly before position ``num_computed - w + 1``, the first key the
        query at ``num_computed`` sees (later queries see less). Null entries are always a leading run, so the
        walk back from the last dead block stops at the first null: its cost is the blocks it frees."""
        counts, dropped = [], False
        for group, (window, table) in enumerate(zip(self.groups.windows, tables)):
            if window is None:
                counts.append(0)
                continue
            num_dead = min(self.groups.first_visible_block(group, num_computed, self.block_size), len(table))
            index, dead = num_dead - 1, []
            while index >= 0 and table[index] != NULL_BLOCK:
                dead.append(table[index])
                table[index] = NULL_BLOCK
                index -= 1
            if dead:
                self._free_blocks(dead, window)
                dropped = True
            counts.append(num_dead)
        if dropped:
            self._null_counts[request.request_id] = tuple(counts)

    def _free_blocks(self, block_ids: Iterable[int], window: int | None) -> None:
        """Drop the holds of a group's table entries (nulls skipped), counting window blocks that went free."""
        live = [b for b in block_ids if b != NULL_BLOCK]
        self.pool.free(live)
        if window is not None:
            self.num_windowed_blocks -= sum(1 for b in live if self.pool.ref_count(b) == 0)

    def swap_out(self, request: Request) -> bool:
        """Preempt by swap: plan the copy of the blocks holding the request's computed tokens (the partly
        filled last one too, cached or not; of a window group only those its next query sees) into host rows,
        and free its blocks. The caller keeps its ``num_computed_tokens``. False, changing nothing, if there is
        no host tier with room (every row pinned or held): the caller preempts by recompute. The copy comes
        before anything this step writes into the freed blocks (``KVTransferPlan``)."""
        if self.swap is None:
            return False
        num_computed = request.num_computed_tokens
        if not self.swap.swap_out(request.request_id, self._live_blocks(request, num_computed), num_computed):
            return False
        self._release_blocks(request)
        return True

    def fork_swapped(self, parent: Request, child: Request) -> bool:
        """``fork`` through the host tier, for when no block is free for its copy: ``child`` (holding no
        blocks) becomes swapped out with a copy of the parent's computed KV, loaded when it is admitted.
        False, changing nothing, if there is no host tier with room, or the parent's KV is still to be loaded
        into its blocks this step."""
        if self.swap is None:
            return False
        num_computed = parent.num_computed_tokens
        blocks = self._live_blocks(parent, num_computed)
        if not self._filled_by_plan().isdisjoint(blocks):  # a parent admitted this step on loaded or swapped-in KV:
            return False  # a swap-out reads its blocks before the plan's loads fill them (KVTransferPlan's order)
        return self.swap.swap_out(child.request_id, blocks, num_computed)

    def _filled_by_plan(self) -> set[int]:
        """The blocks the plan being made copies KV into from the host tier (loads, swap-ins)."""
        filled = self.tier_plan.loaded_blocks() if self.tier_plan is not None else set()
        return filled | (self.swap.swapped_in_blocks() if self.swap is not None else set())

    def is_swapped_out(self, request: Request) -> bool:
        return self.swap is not None and request.request_id in self.swap

    def _live_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """The blocks holding KV of the request's first ``num_tokens`` tokens that its query at ``num_tokens``
        sees, group after group (``KVCacheGroups.visible_entries``): what a swap keeps. A window group's earlier
        entries may still name blocks (dropped only at the next allocation), never null later ones."""
        blocks = [b for _, _, b in self.groups.visible_entries(self.tables(request), num_tokens, self.block_size)]
        assert NULL_BLOCK not in blocks, f"request {request.request_id} lost a block its next query sees"
        return blocks

    def _swap_in(self, request: Request, swapped: SwappedKV, num_new_tokens: int) -> bool:
        """Blocks for a swapped-out request's KV and ``num_new_tokens`` more, all or nothing: of its KV, the blocks
        that the prefix tree still holds on the device (group 0's leading full blocks, and the window groups'
        blocks beside those nodes) are taken back as they are, and fresh blocks get the rest loaded; a window
        group's table starts with nulls up to the first block the request's next query sees::

            swapped KV:  | r7       | r2       | r5       | r4: 3 of 4 slots |
            block_ids:   | b3 (hit) | b9 (hit) | b1 (load r5) | b6 (load r4) | b8 (new tokens) |

        Fresh blocks of known tokens join the tree pending, so that no offload of this step reads them before
        their load: the step's end marks the loaded ones computed (``cache_computed``)."""
        assert self.swap is not None and not request.block_ids, f"{request.request_id} holds blocks"
        num_swapped = swapped.num_tokens
        nodes: tuple[PrefixNode, ...] = ()
        if self.prefix_cache is not None:
            nodes = self.prefix_cache.match(request.token_ids, num_swapped // self.block_size,
                                           namespace=request.cache_namespace).nodes
        num_blocks = self.num_blocks_for(num_swapped)
        unmatched = [NULL_BLOCK] * (num_blocks - len(nodes))
        tables = [[node.block_id for node in nodes] + unmatched]
        for group in range(1, self.groups.num_groups):
            tables.append([node.group_block_ids[group - 1] for node in nodes] + unmatched)
        rows = self.groups.visible_entries(tables, num_swapped, self.block_size)
        for group, table in enumerate(tables):  # entries before the rows' are dead: not taken back
            first = self.groups.first_visible_block(group, num_swapped, self.block_size)
            table[:first] = [NULL_BLOCK] * first
        to_load = [(group, index) for group, index, block_id in rows if block_id == NULL_BLOCK]
        num_needed = self.num_blocks_for(num_swapped + num_new_tokens) - num_blocks
        num_revived = sum(1 for table in tables for b in table if b != NULL_BLOCK and self.pool.ref_count(b) == 0)
        if num_needed * len(tables) + len(to_load) + num_revived > self.pool.num_free_blocks:
            return False
        self._hold(tables)  # first, so that the allocation below cannot evict them
        fresh = dict(zip(to_load, self._fill(tables, to_load, num_needed)))
        self.swap.swap_in(request.request_id, [fresh.get((group, index)) for group, index, _ in rows])
        request.block_ids, request.group_block_ids = tables[0], tables[1:]
        self.paths.start(request, nodes, 0)
        return True

    def take_tier_transfers(self) -> tuple[
        tuple[tuple[int, int], ...], tuple[tuple[int, int], ...],
        tuple[tuple[int, int], ...], tuple[tuple[int, int], ...],
    ]:
        """The offloads ((block_id, host row) copied out), loads ((host row, block_id) copied in), swap-outs
        ((block_id, host row)) and swap-ins ((host row, block_id)) planned since the last call, for the runner
        to apply before the next forward pass in the order of ``KVTransferPlan``. The runner must have applied
        the plan taken before (the engine executes a step before it schedules the next): swap rows whose last
        copy it held go back to the host tier first, where this plan's offloads may take them."""
        swap_outs, swap_ins = self.swap.take_transfers() if self.swap is not None else ((), ())
        offloads, loads = self.tier_plan.take() if self.tier_plan is not None else ((), ())
        return offloads, loads, swap_outs, swap_ins

    def abandon_transfers(self) -> None:
        """Drop the moves planned and never applied (a step raised; its requests have finished, committing nothing:
        ``Scheduler.abandon``): the offloads of the last plan taken are not published, and the loads and swap-ins
        planned since are not copied into blocks that are no longer theirs (their host rows go back)."""
        if self.tier_plan is not None:
            self.tier_plan.abandon()
        if self.swap is not None:
            self.swap.abandon()
        if self.store is not None:
            self.store.abandon_offloads()

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past those its first ``num_tokens`` tokens need: blocks taken for
        draft tokens that verification rejected. Their slots hold no known token, so none is on the tree::

            block_ids:  | b0 full | b1: last tokens | b5: rejected drafts only |   -> b5 freed
        """
        num_kept = self.num_blocks_for(num_tokens)
        if len(request.block_ids) <= num_kept:
            return
        assert self.paths.num_path_blocks(request.request_id) <= num_kept, (
            "a block past the request's known tokens is cached"
        )
        for window, table in zip(self.groups.windows, self.tables(request)):
            self._free_blocks(reversed(table[num_kept:]), window)
            del table[num_kept:]

    def free(self, request: Request) -> None:
        """Release the request's hold on all its blocks (shared ones stay with their other holders); its
        computed cached blocks stay in the tree, evictable, and its pending ones leave it. A request freed
        while swapped out gives its host rows back."""
        if self.swap is not None:
            self.swap.drop(request.request_id)
        self._release_blocks(request)

    def _release_blocks(self, request: Request) -> None:
        self._forget_match(request)
        self.paths.drop(request)
        self._null_counts.pop(request.request_id, None)
        # Tail blocks first: the evictable queue must see descendants before their ancestors.
        for window, table in zip(self.groups.windows, self.tables(request)):
            self._free_blocks(reversed(table), window)
        request.block_ids, request.group_block_ids = [], []

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]]:
        """Give ``child`` (which holds no blocks) the KV of the parent's computed tokens, copy-on-write.

        The full blocks are shared (one more holder each); the partly filled last block, which both will
        go on writing, is copied into a fresh block. Returns the (src, dst) copies the runner must apply
        before the next forward pass. Raises NoFreeBlocksError, changing nothing, when no block is free::

            parent:  | full b0 | full b1 | b2: 3 of 4 slots |
            child:   | full b0 | full b1 | b7: copy of b2   |     (b0, b1 now held twice)
        """
        if child.block_ids:
            raise ValueError(f"request {child.request_id} already holds blocks; only a fresh request can fork")
        copies = self._fork_tables(parent, child)
        self.paths.fork(parent, child)
        return copies

    def _fork_tables(self, parent: Request, child: Request) -> list[tuple[int, int]]:
        """``fork``'s tables: each group's shared (its nulls stay null) but for the partial block, copied; all or
        nothing. The partial block is never null: it holds the parent's next query position."""
        num_full, num_partial = divmod(parent.num_computed_tokens, self.block_size)
        tables = self.tables(parent)
        if num_partial and len(tables) > self.pool.num_free_blocks:
            raise NoFreeBlocksError(f"forking needs {len(tables)} blocks, {self.pool.num_free_blocks} are free")
        copies, child_tables = [], []
        for window, table in zip(self.groups.windows, tables):
            shared = table[:num_full]
            self.pool.incref(b for b in shared if b != NULL_BLOCK)
            if num_partial:
                (dst,) = self.pool.allocate(1)
                copies.append((table[num_full], dst))
                shared.append(dst)
                self.num_windowed_blocks += window is not None
            child_tables.append(shared)
        child.block_ids, child.group_block_ids = child_tables[0], child_tables[1:]
        return copies

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Every block's reference count equals the number of the given live requests holding it, free +
        held = total, the prefix tree agrees with the pool and the requests' paths, and only live requests hold
        swapped-out KV. ``requests`` must be every live request that holds blocks or is swapped out. Raises
        AssertionError."""
        requests = list(requests)
        self.pool.check_integrity()
        holders: Counter[int] = Counter()
        windowed: set[int] = set()
        for request in requests:
            self._check_tables(request, holders, windowed)
        assert len(windowed) == self.num_windowed_blocks, (
            f"{len(windowed)} blocks held in window groups, counted {self.num_windowed_blocks}"
        )
        wrong = {
            b: (self.pool.ref_count(b), holders[b])
            for b in range(self.pool.num_blocks)
            if self.pool.ref_count(b) != holders[b]
        }
        assert not wrong, f"block: (reference count, live holders) disagree: {wrong}"
        num_held = len(holders)
        assert self.pool.num_free_blocks + num_held == self.pool.num_blocks, (
            f"{self.pool.num_free_blocks} free + {num_held} held != {self.pool.num_blocks} blocks"
        )
        self.paths.check(requests)
        if self.swap is not None:
            self.swap.check_integrity(request.request_id for request in requests)
        elif self.store is not None:
            self.store.check_integrity([])

    def _check_tables(self, request: Request, holders: Counter[int], windowed: set[int]) -> None:
        """A request's tables match the groups, hold no block twice, and have nulls only in a leading run of a window
        group; adds its blocks to ``holders`` and its window groups' to ``windowed``."""
        tables = self.tables(request)
        assert len({len(t) for t in tables}) == 1 and len(tables) == self.groups.num_groups or not any(tables), (
            f"request {request.request_id}'s tables do not match the groups: {tables}"
        )
        held = [b for table in tables for b in table if b != NULL_BLOCK]
        duplicates = [b for b, count in Counter(held).items() if count > 1]
        assert not duplicates, f"request {request.request_id} holds blocks {duplicates} more than once"
        holders.update(held)
        for window, table in zip(self.groups.windows, tables):
            nulls = [i for i, b in enumerate(table) if b == NULL_BLOCK]
            assert nulls == list(range(len(nulls))) and (window is not None or not nulls), (
                f"request {request.request_id}'s null entries are not a leading run of a window group: {table}"
            )
            if window is not None:
                windowed.update(b for b in table if b != NULL_BLOCK)


__all__ = ["KVCacheManager", "NoFreeBlocksError"]
