"""Prefix matches continued below the device: the blocks after a device match of the prefix tree that the KV
tiers hold, found by content key (``block_keys``), loaded from the host tier into fresh blocks, or read from the
disk into the host tier while the request waits. ``KVCacheManager.match_prefix`` asks it whenever the tree's
match stops short (or windows may need blocks below the device)."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Callable

from kvserve.kv.block_keys import KeyedBlock, block_key, group_key
from kvserve.kv.groups import NULL_BLOCK, KVCacheGroups
from kvserve.kv.prefix_cache import PrefixCache, PrefixMatch, PrefixNode
from kvserve.kv.reload_costs import ReloadCosts
from kvserve.kv.tiers import Tier, TieredStore
from kvserve.request import Request

# lookups (about two a step under lpm) in which a waiting request may find its prefix still coming off the
# disk before it computes it instead
MAX_LOAD_WAITS = 200


class TierMatcher:
    """Extends device matches through the tiers; remembers how many lookups each waiting request has waited on
    disk reads, and weighs reads against recomputing (``reload_costs``, fed by the engine)."""

    def __init__(self, store: TieredStore, prefix_cache: PrefixCache, groups: KVCacheGroups, block_size: int,
                 reload_costs: ReloadCosts) -> None:
        self.store = store
        self.prefix_cache = prefix_cache
        self.groups = groups
        self.block_size = block_size
        self.reload_costs = reload_costs
        self._load_waits: Counter[str] = Counter()  # lookups in which each waiting request waited on disk reads
        # the blocks each waiting request needs staged in the host tier (read, or being read, until it loads
        # them): group 0's, which size the others' room, and the window groups'; rows neither offloads nor
        # another waiting request's reads may take
        self._staging: dict[str, frozenset[bytes]] = {}
        self._window_staging: dict[str, frozenset[bytes]] = {}

    def forget(self, request_id: str) -> None:
        """The request took its blocks or left: its waits start again from nothing, its staged blocks are no
        longer kept from others' reads."""
        self._load_waits.pop(request_id, None)
        if self._staging.pop(request_id, None) is not None:
            self._window_staging.pop(request_id, None)
            self._keep_staged()

    def _staging_room(self, request_id: str, wanted: list[KeyedBlock]) -> int:
        """The blocks (of every group) this request may have staged at once: the host tier's staging rows less
        those other waiting requests' staged blocks hold (their reads would evict each other's before they load,
        lookup after lookup: 60 reads for 12 blocks used); blocks it shares with them (a common prefix) are not
        counted against it. Each of their group-0 blocks counts a block of every group, more than the window
        blocks they hold: that slack absorbs rows that writes pin for a while, which, counted exactly, shrank the
        rooms of requests already staged, which then let go of blocks they had read (Gemma 3: 13 of 90 read
        again)."""
        mine = {block.key for block in wanted}
        held = set().union(*(keys for rid, keys in self._staging.items() if rid != request_id)) - mine
        return max(0, self.store.staging_rows() - len(held) * self.groups.num_groups)

    def extend(self, request: Request, match: PrefixMatch, max_blocks: int) -> PrefixMatch:
        """Extend a device match with the blocks the host tier holds next; if the disk holds more, start reading
        them into the host tier (as many as its rows can stage at once) and say the request should wait for them
        (for at most ``MAX_LOAD_WAITS`` lookups, then it computes them), unless reading has measured slower than
        computing them (``reload_costs``). With window groups, a match is as long as its next query finds the
        window groups' blocks it sees on the device or in the host tier, and the disk is read for those that a
        longer match would need::

            w = 6, block_size 4      n: device nodes, h: host tier, d: disk, '.': dead to the query at 20
            group 0:       | n0 | n1 | n2 | h3 | h4 | d5 |
            window group:  |  . |  . |  . | h3 | h4 | d5 |   a match of 5 blocks (h3s, h4s loaded); d5s read, wait
        """
        nodes = match.nodes
        beyond, num_host = self._blocks_beyond(request, match, max_blocks)
        where = functools.cache(functools.partial(self._window_tier, nodes, beyond))
        num_ready = self.groups.visible_length(len(nodes) + num_host, self.block_size,
                                               lambda g, index: where(g, index) is Tier.HOST)
        # No more than the host tier can stage for this request (a block of each group a block at most): reading
        # more would evict the first reads before they load, lookup after lookup; what is beyond is computed
        staged = len(nodes) + self._staging_room(request.request_id, beyond) // self.groups.num_groups
        num_found = self.groups.visible_length(min(len(nodes) + len(beyond), staged), self.block_size,
                                               lambda g, index: where(g, index) is not None)
        window_blocks = self._window_blocks_in_tiers(nodes, beyond, num_found, where)
        window_reads = [block for block, tier in window_blocks if tier is Tier.DISK]
        loading = self._plan_reads(request.request_id, nodes, beyond, num_host, num_ready, num_found, window_reads)
        self._remember_staging(request.request_id, beyond[: max(0, num_found - len(nodes))],
                               [block for block, _ in window_blocks])
        tiered = tuple(block.key for block in beyond[: max(0, num_ready - len(nodes))])
        return PrefixMatch(nodes[:num_ready], self.block_size, tiered=tiered, loading=loading)

    def _plan_reads(self, request_id: str, nodes: tuple[PrefixNode, ...], beyond: list[KeyedBlock], num_host: int,
                    num_ready: int, num_found: int, window_reads: list[KeyedBlock]) -> bool:
        """Whether the request should wait for disk reads: if a match of ``num_found`` blocks would be longer than
        the ``num_ready`` ready now, start reading the blocks it needs that only the disk has (group 0's after
        the ``num_host`` in the host tier, then ``window_reads``, the window groups'). Not once the request has
        waited ``MAX_LOAD_WAITS`` lookups, nor when reading has measured slower than computing: then it computes
        them, and asks no more."""
        waits = self._load_waits[request_id]
        loading = False
        if num_found > num_ready and waits < MAX_LOAD_WAITS:
            if self.reload_costs.disk_read_pays(*self.store.disk_read_cost(), self.block_size):
                to_read = beyond[num_host : max(num_host, num_found - len(nodes))] + window_reads
                loading = self.store.prefetch(to_read) > 0
            else:
                self.store.skip_reads(num_found - num_ready)
                waits = MAX_LOAD_WAITS
        self._load_waits[request_id] = waits + loading
        return loading

    def _remember_staging(self, request_id: str, staged: list[KeyedBlock], window_staged: list[KeyedBlock]) -> None:
        """Keep ``staged`` (group 0's blocks below the device that the request's match found: in the host tier, or
        read or being read into it) and ``window_staged`` (the window groups' blocks that match needs from the
        tiers) from offloads and other requests' reads, until the request takes them (``forget``) or needs them
        no more."""
        if staged or window_staged:
            self._staging[request_id] = frozenset(block.key for block in staged)
            self._window_staging[request_id] = frozenset(block.key for block in window_staged)
        else:
            self._staging.pop(request_id, None)
            self._window_staging.pop(request_id, None)
        self._keep_staged()

    def _keep_staged(self) -> None:
        self.store.keep_staged(frozenset().union(*self._staging.values(), *self._window_staging.values()))

    def _blocks_beyond(self, request: Request, match: PrefixMatch, max_blocks: int) -> tuple[list[KeyedBlock], int]:
        """Group 0's blocks after a device match that the tiers hold, in order, and how many lead in the host
        tier (the rest are on the disk or being read from it, or follow one that is)."""
        parent = match.nodes[-1].content_key if match.nodes else self.prefix_cache.content_root(request.cache_namespace)
        assert parent is not None
        beyond: list[KeyedBlock] = []
        num_host = 0
        for tokens in self.prefix_cache.keys(request.token_ids, len(match.nodes), max_blocks - len(match.nodes)):
            key = block_key(parent, tokens)
            tier = self._tier_of(key)
            if tier is None:
                break
            num_host += tier is Tier.HOST and num_host == len(beyond)
            beyond.append(KeyedBlock(key, parent, tokens))
            parent = key
        return beyond, num_host

    def _tier_of(self, key: bytes) -> Tier | None:
        """Where a block is below the device: HOST (ready to load), DISK (on the disk, or being read), or None."""
        return self.store.locate(key) or (Tier.DISK if self.store.is_reading(key) else None)

    def _window_tier(self, nodes: tuple[PrefixNode, ...], beyond: list[KeyedBlock], group: int,
                     index: int) -> Tier | None:
        """Where window group ``group``'s block of the match's block ``index`` is: HOST if on the device (beside
        its node) or in the host tier, DISK if on the disk or being read, else None."""
        if _beside_node(nodes, group, index):
            return Tier.HOST
        return self._tier_of(group_key(self._keyed(nodes, beyond, index).key, group))

    def _keyed(self, nodes: tuple[PrefixNode, ...], beyond: list[KeyedBlock], index: int) -> KeyedBlock:
        """Group 0's block ``index`` of a device match followed by ``beyond``, named by its content."""
        if index >= len(nodes):
            return beyond[index - len(nodes)]
        node = nodes[index]
        assert node.content_key is not None and node.parent is not None and node.parent.content_key is not None
        return KeyedBlock(node.content_key, node.parent.content_key, node.key)

    def _window_blocks_in_tiers(self, nodes: tuple[PrefixNode, ...], beyond: list[KeyedBlock], num_blocks: int,
                                where: Callable[[int, int], Tier | None]) -> list[tuple[KeyedBlock, Tier]]:
        """The window groups' blocks that a match of ``num_blocks`` blocks needs and only the tiers have (none
        beside its node on the device), each with the tier it is in."""
        blocks = []
        for group in range(1, self.groups.num_groups):
            for index in range(self.groups.first_visible_block(group, num_blocks * self.block_size, self.block_size),
                               num_blocks):
                tier = where(group, index)
                if tier is not None and not _beside_node(nodes, group, index):
                    key, parent_key, tokens, _ = self._keyed(nodes, beyond, index)
                    blocks.append((KeyedBlock(group_key(key, group), parent_key, tokens, group), tier))
        return blocks


def _beside_node(nodes: tuple[PrefixNode, ...], group: int, index: int) -> bool:
    """Whether window group ``group``'s block of the match's block ``index`` is on the device, beside its node."""
    return index < len(nodes) and nodes[index].group_block_ids[group - 1] != NULL_BLOCK
