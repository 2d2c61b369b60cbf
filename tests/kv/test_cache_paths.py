from __future__ import annotations

import pytest

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.cache_paths import CachePaths
from kvserve.kv.groups import NULL_BLOCK
from kvserve.kv.prefix_cache import PrefixCache
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BLOCK = 4


def paths_over(num_blocks: int = 8) -> CachePaths:
    pool = BlockPool(num_blocks)
    paths = CachePaths(pool, BLOCK, PrefixCache(BLOCK), tier_plan=None)
    pool.on_evict = paths.on_evict
    return paths


def holding(paths: CachePaths, request_id: str, num_tokens: int, num_blocks: int) -> Request:
    """A request of ``num_tokens`` prompt tokens holding ``num_blocks`` fresh blocks, none computed."""
    r = Request(request_id, list(range(1, num_tokens + 1)), SamplingParams())
    r.block_ids = paths.pool.allocate(num_blocks)
    return r


def test_blocks_of_known_tokens_hang_pending_until_computed() -> None:
    paths = paths_over()
    r = holding(paths, "r", 10, 3)  # blocks 0 and 1 full of known tokens, block 2 not
    paths.extend(r, 0)
    assert paths.num_path_blocks("r") == 2 and paths.num_cached_blocks == 2
    assert [paths.pool.is_cached(b) for b in r.block_ids] == [True, True, False]
    r.num_computed_tokens = 10
    paths.cache_computed(r)
    assert paths.prefix_cache is not None
    assert paths.prefix_cache.match(r.token_ids, 2).block_ids == r.block_ids[:2]
    paths.check([r])


def test_a_fork_walks_the_parents_computed_path_not_its_pending_tail() -> None:
    paths = paths_over()
    parent = holding(paths, "p", 12, 3)
    parent.num_computed_tokens = 4
    paths.extend(parent, 4)  # block 0 computed, blocks 1 and 2 pending
    child = Request("c", parent.prompt_token_ids, SamplingParams(), block_ids=parent.block_ids[:1])
    paths.pool.incref(child.block_ids)
    paths.fork(parent, child)
    assert paths.num_path_blocks("c") == 1
    paths.check([parent, child])


def test_dropping_a_path_takes_its_pending_nodes_out_of_the_tree() -> None:
    paths = paths_over()
    r = holding(paths, "r", 8, 2)
    r.num_computed_tokens = 4
    paths.extend(r, 4)
    paths.drop(r)
    assert paths.num_path_blocks("r") == 0 and paths.num_cached_blocks == 1  # the computed block stays
    paths.pool.free(r.block_ids)
    assert paths.pool.num_evictable_blocks == 1
    paths.check([])


def test_check_finds_a_path_off_its_requests_blocks() -> None:
    paths = paths_over()
    r = holding(paths, "r", 8, 2)
    paths.extend(r, 8)
    r.block_ids.reverse()
    with pytest.raises(AssertionError, match="not on its tree path"):
        paths.check([r])
    with pytest.raises(AssertionError, match="has a tree path but holds no blocks"):
        paths.check([])


def test_an_evicted_group_block_leaves_its_node_which_stays() -> None:
    paths = paths_over()
    r = holding(paths, "r", 4, 1)
    r.group_block_ids = [paths.pool.allocate(1)]
    r.num_computed_tokens = 4
    paths.extend(r, 4)
    (group_block,) = r.group_block_ids[0]
    assert paths.num_cached_blocks == 2
    paths.pool.free(r.group_block_ids[0])  # the window group's block, dead to the request, freed alone
    paths.pool.allocate(paths.pool.num_free_blocks)  # evicts it
    assert paths.prefix_cache is not None
    (node,) = paths.prefix_cache.nodes()
    assert node.group_block_ids == [NULL_BLOCK] and paths.num_evictions == 1 and paths.num_cached_blocks == 1
    assert not paths.pool.is_cached(group_block)
