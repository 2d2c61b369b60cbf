from __future__ import annotations

from typing import Sequence

from kvserve.kv.block_keys import KeyedBlock, group_key
from kvserve.kv.groups import NULL_BLOCK
from kvserve.kv.prefix_cache import PrefixCache
from kvserve.kv.tier_plan import TierPlan


class WantsAll:
    """What a TierPlan asks of a ``TieredStore``: here it wants every block offered, gives offload ``i`` of a plan
    row 100 + i and load ``i`` row 200 + i, and keeps the blocks it was handed."""

    root_key = b"root"

    def __init__(self) -> None:
        self.offloaded: list[tuple[int, KeyedBlock]] = []
        self.loaded: list[tuple[bytes, int]] = []

    def wants_offload(self, key: bytes, evicted: bool) -> bool:
        return True

    def reserve_offload_rows(self, blocks: Sequence[tuple[int, KeyedBlock]]) -> tuple[tuple[int, int], ...]:
        self.offloaded.extend(blocks)
        return tuple((block_id, 100 + i) for i, (block_id, _) in enumerate(blocks))

    def take_load_rows(self, loads: Sequence[tuple[bytes, int]]) -> tuple[tuple[int, int], ...]:
        self.loaded.extend(loads)
        return tuple((200 + i, block_id) for i, (_, block_id) in enumerate(loads))


def test_a_nodes_group_blocks_are_offered_with_it_each_under_its_groups_key() -> None:
    cache = PrefixCache(2)
    cache.root.content_key = WantsAll.root_key
    node = cache.add(cache.root, (1, 2), block_id=3, computed=True)
    assert node is not None
    node.content_key, node.group_block_ids = b"k", [5, NULL_BLOCK]
    store = WantsAll()
    plan = TierPlan(store)  # type: ignore[arg-type]
    plan.offer(node, evicted=True)
    plan.offer(node, evicted=False)  # offered twice in a step: copied once
    offloads, loads = plan.take()
    assert [(block_id, block.key, block.group) for block_id, block in store.offloaded] == [
        (3, group_key(b"k", 0), 0), (5, group_key(b"k", 1), 1)]
    assert offloads == ((3, 100), (5, 101))
    assert loads == () and plan.take() == ((), ()) and len(store.offloaded) == 2


def test_loads_are_taken_in_order_once() -> None:
    store = WantsAll()
    plan = TierPlan(store)  # type: ignore[arg-type]
    plan.add_loads([(b"a", 1), (b"b", 2)])
    assert plan.take() == ((), ((200, 1), (201, 2))) and plan.take() == ((), ())
    assert store.loaded == [(b"a", 1), (b"b", 2)]
