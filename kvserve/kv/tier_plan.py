"""TierPlan: the copies between the device pool and the KV tiers planned since the last step, for the runner to
apply before the next forward pass (``KVTransferPlan.offloads`` and ``loads``).

Offloads: a computed block's content is final, so it is offered to the tiers when it is computed (the tiers take
it then only to write it through to the disk) and when the pool evicts it (``TieredStore.wants_offload``); its
content stays valid until the runner applies this step's plan. Every group's block of a prefix-tree node is a tier
block of its own, under its group's key (``block_keys.group_key``, chained from group 0's): a node's group blocks
are offered with it, and a window block evicted alone by itself. Loads: fresh blocks that a match through the tiers
fills from the host tier (pinned there until the plan is taken). ``take`` has the store pick their host rows, so
the runner copies rows and knows no content key.
"""

from __future__ import annotations

from typing import Iterable

from kvserve.kv.block_keys import KeyedBlock, group_key
from kvserve.kv.groups import NULL_BLOCK
from kvserve.kv.prefix_cache import PrefixNode
from kvserve.kv.tiers import TieredStore


class TierPlan:
    """The offloads and loads planned since the last ``take``."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self._offloads: dict[bytes, tuple[int, KeyedBlock]] = {}  # by key: a block offered twice is copied once
        self._loads: list[tuple[bytes, int]] = []

    def offer(self, node: PrefixNode, evicted: bool) -> None:
        """Offer a computed node's block and the other groups' blocks beside it (evicted from the pool, or newly
        computed)."""
        self.offer_block(node, 0, node.block_id, evicted)
        for group, block_id in enumerate(node.group_block_ids, start=1):
            if block_id != NULL_BLOCK:
                self.offer_block(node, group, block_id, evicted)

    def offer_block(self, node: PrefixNode, group: int, block_id: int, evicted: bool) -> None:
        """Offer group ``group``'s block of a node's tokens, under that group's key."""
        key, parent = node.content_key, node.parent
        assert key is not None and parent is not None and parent.content_key is not None
        block = KeyedBlock(group_key(key, group), parent.content_key, node.key, group)
        if self.store.wants_offload(block.key, evicted):
            self._offloads[block.key] = (block_id, block)

    def add_loads(self, loads: Iterable[tuple[bytes, int]]) -> None:
        """Plan copies of host-tier blocks ((content key, block_id)) into fresh device blocks."""
        self._loads.extend(loads)

    def loaded_blocks(self) -> set[int]:
        """The blocks the loads planned since the last take copy KV into."""
        return {block_id for _, block_id in self._loads}

    def abandon(self) -> None:
        """Forget the offloads and loads planned since the last ``take`` (a step raised before it was taken): the
        loads' host blocks are unpinned."""
        self.store.unpin([key for key, _ in self._loads])
        self._offloads.clear()
        self._loads.clear()

    def drop_offloads(self) -> None:
        """Forget the offloads planned since the last ``take`` (the tiers were just emptied: these would fill them
        again with what was cached before)."""
        self._offloads.clear()

    def take(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The offloads ((block_id, host row) copied out) and loads ((host row, block_id) copied in) planned since
        the last call, their rows picked now. The offloads' rows first: a load's block stays pinned until then, so
        that no offload of this plan takes the row it is loaded from."""
        offloads = self.store.reserve_offload_rows(tuple(self._offloads.values()))
        loads = self.store.take_load_rows(self._loads)
        self._offloads.clear()
        self._loads.clear()
        return offloads, loads
