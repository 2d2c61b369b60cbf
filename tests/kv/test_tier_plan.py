from __future__ import annotations

from kvserve.kv.block_keys import group_key
from kvserve.kv.groups import NULL_BLOCK
from kvserve.kv.prefix_cache import PrefixCache
from kvserve.kv.tier_plan import TierPlan


class WantsAll:
    """What a TierPlan asks of a ``TieredStore``: here it wants every block offered."""

    root_key = b"root"

    def wants_offload(self, key: bytes, evicted: bool) -> bool:
        return True


def test_a_nodes_group_blocks_are_offered_with_it_each_under_its_groups_key() -> None:
    cache = PrefixCache(2)
    cache.root.content_key = WantsAll.root_key
    node = cache.add(cache.root, (1, 2), block_id=3, computed=True)
    assert node is not None
    node.content_key, node.group_block_ids = b"k", [5, NULL_BLOCK]
    plan = TierPlan(WantsAll())  # type: ignore[arg-type]
    plan.offer(node, evicted=True)
    plan.offer(node, evicted=False)  # offered twice in a step: copied once
    offloads, loads = plan.take()
    assert [(block_id, block.key, block.group) for block_id, block in offloads] == [
        (3, group_key(b"k", 0), 0), (5, group_key(b"k", 1), 1)]
    assert loads == () and plan.take() == ((), ())


def test_loads_are_taken_in_order_once() -> None:
    plan = TierPlan(WantsAll())  # type: ignore[arg-type]
    plan.add_loads([(b"a", 1), (b"b", 2)])
    assert plan.take() == ((), ((b"a", 1), (b"b", 2))) and plan.take() == ((), ())
