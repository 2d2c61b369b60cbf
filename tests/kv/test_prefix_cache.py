"""The radix tree, the pool's evictable queue, and the KV manager with prefix caching on."""

from __future__ import annotations

import pytest

from kvserve.kv.block_keys import CacheNamespace
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix_cache import PrefixCache
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BLOCK = 4


def request(request_id: str, prompt: list[int], **params) -> Request:
    return Request(request_id, prompt, SamplingParams(**params))


def compute(kv: KVCacheManager, r: Request, num_tokens: int, prefix=None) -> None:
    """What a scheduled step does to the cache: allocate, compute, publish the computed blocks."""
    assert kv.allocate_slots(r, num_tokens, prefix)
    r.num_computed_tokens = (prefix.num_tokens if prefix else r.num_computed_tokens) + num_tokens
    kv.cache_computed(r)


# ------------------------------------------------------------------------------------------------ tree


def test_match_walks_whole_blocks_and_stops_at_the_first_miss() -> None:
    cache = PrefixCache(BLOCK)
    a = cache.add(cache.root, (1, 2, 3, 4), block_id=7, computed=True)
    assert a is not None
    cache.add(a, (5, 6, 7, 8), block_id=3, computed=True)
    match = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9], max_blocks=10)
    assert match.block_ids == [7, 3] and match.num_tokens == 8 and not match.sibling_computing
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 9], max_blocks=10).block_ids == [7]
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8], max_blocks=1).block_ids == [7]
    assert cache.match([1, 2, 3], max_blocks=10).block_ids == []  # not one whole block


def test_a_pending_node_stops_the_match_and_says_a_sibling_computes_it() -> None:
    cache = PrefixCache(BLOCK)
    a = cache.add(cache.root, (1, 2, 3, 4), block_id=0, computed=True)
    cache.add(a, (5, 6, 7, 8), block_id=1, computed=False)
    match = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9], max_blocks=10)
    assert match.block_ids == [0] and match.sibling_computing


def test_a_remembered_match_whose_nodes_left_the_tree_is_walked_again() -> None:
    """``start`` is reused only while its nodes are in the tree: here its blocks were evicted and cached again
    under other tokens, so reusing it would hand out KV of another prompt."""
    cache = PrefixCache(BLOCK)
    a = cache.add(cache.root, (1, 2, 3, 4), block_id=0, computed=True)
    cache.add(a, (5, 6, 7, 8), block_id=1, computed=True)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    first = cache.match(tokens, max_blocks=10)
    assert first.block_ids == [0, 1]
    cache.remove(1)
    cache.remove(0)
    x = cache.add(cache.root, (20, 21, 22, 23), block_id=1, computed=True)
    cache.add(x, (24, 25, 26, 27), block_id=0, computed=True)
    assert cache.match(tokens, max_blocks=10, start=first).block_ids == []

def test_add_refuses_a_second_block_for_the_same_tokens_and_bad_keys() -> None:
    cache = PrefixCache(BLOCK)
    assert cache.add(cache.root, (1, 2, 3, 4), block_id=0, computed=True) is not None
    assert cache.add(cache.root, (1, 2, 3, 4), block_id=1, computed=True) is None
    assert cache.num_nodes == 1
    with pytest.raises(ValueError, match="one block of 4 tokens"):
        cache.add(cache.root, (1, 2), block_id=2, computed=True)
    with pytest.raises(ValueError, match="already in the prefix cache"):
        cache.add(cache.root, (9, 9, 9, 9), block_id=0, computed=True)


def test_only_a_leaf_can_be_removed() -> None:
    cache = PrefixCache(BLOCK)
    a = cache.add(cache.root, (1, 2, 3, 4), block_id=0, computed=True)
    cache.add(a, (5, 6, 7, 8), block_id=1, computed=True)
    with pytest.raises(AssertionError, match="not a leaf"):
        cache.remove(0)
    cache.remove(1)
    cache.remove(0)
    assert cache.num_nodes == 0 and not cache.root.children


# ------------------------------------------------------------------------------------------------ pool


def test_allocation_takes_worthless_blocks_before_evicting_cached_ones_oldest_first() -> None:
    evicted: list[int] = []
    pool = BlockPool(4, on_evict=evicted.append)
    blocks = pool.allocate(3)
    for b in blocks:
        pool.mark_cached(b)
    pool.free(blocks)  # released in this order: blocks[0] is the least recently used
    assert pool.num_free_blocks == 4 and pool.evictable_order() == blocks
    (untouched,) = set(range(4)) - set(blocks)
    assert pool.allocate(1) == [untouched] and evicted == []
    assert pool.allocate(2) == blocks[:2] and evicted == blocks[:2]
    assert not pool.is_cached(blocks[0])
    pool.check_integrity()


def test_take_revives_an_evictable_block_and_its_release_makes_it_most_recent() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for b in blocks:
        pool.mark_cached(b)
    pool.free(blocks)
    pool.take([blocks[0]])
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free_blocks == 2
    pool.free([blocks[0]])
    assert pool.evictable_order() == [blocks[1], blocks[2], blocks[0]]
    pool.check_integrity()


def test_caching_errors_name_the_block() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 0 is free; only a held block can be cached"):
        pool.mark_cached(0)
    with pytest.raises(ValueError, match="block 1 is not cached"):
        pool.take([1])
    (b,) = pool.allocate(1)
    pool.mark_cached(b)
    pool.free([b])
    with pytest.raises(ValueError, match="uncache it by eviction only"):
        pool.unmark_cached(b)


# ---------------------------------------------------------------------------------------------- manager


def test_a_finished_prompt_is_reused_and_its_blocks_are_shared_not_copied() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    first = request("a", list(range(1, 11)))  # 10 tokens: 2 full blocks
    compute(kv, first, 10)
    second = request("b", list(range(1, 11)) + [50, 51])
    match = kv.match_prefix(second)
    assert match.block_ids == first.block_ids[:2] and match.num_tokens == 8
    compute(kv, second, 4, match)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert [kv.pool.ref_count(b) for b in first.block_ids[:2]] == [2, 2]
    kv.check_integrity([first, second])
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks() == 16 and kv.num_cached_blocks == 3  # a's 2 blocks + b's third block
    kv.check_integrity([])


def test_at_least_one_token_is_left_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    first = request("a", list(range(1, 9)))  # exactly 2 blocks
    compute(kv, first, 8)
    kv.free(first)
    assert kv.match_prefix(request("b", list(range(1, 9)))).num_tokens == 4


def test_a_capped_match_and_a_disabled_cache_match_no_more_than_allowed() -> None:
    # the scheduler caps a prompt-logprobs request's match at the positions whose logprobs it has returned
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    compute(kv, request("a", list(range(1, 10))), 9)
    assert kv.match_prefix(request("b", list(range(1, 10)), prompt_logprobs=1), 0).num_tokens == 0
    assert kv.match_prefix(request("c", list(range(1, 10)), prompt_logprobs=1), 7).num_tokens == 4
    assert kv.match_prefix(request("d", list(range(1, 10)))).num_tokens == 8
    off = KVCacheManager(num_blocks=8, block_size=BLOCK)
    r = request("a", list(range(1, 10)))
    compute(off, r, 9)
    off.free(r)
    assert off.match_prefix(request("b", list(range(1, 10)))).num_tokens == 0 and off.num_cached_blocks == 0


def test_prompt_blocks_are_pending_until_computed_and_dropped_if_never_computed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    first = request("a", list(range(1, 14)))
    assert kv.allocate_slots(first, 13)
    sibling = request("b", list(range(1, 14)))
    assert kv.match_prefix(sibling).sibling_computing
    kv.free(first)  # aborted before its step ran: nothing it allocated may be reused
    assert kv.num_cached_blocks == 0 and not kv.match_prefix(sibling).sibling_computing
    kv.check_integrity([])


def test_eviction_frees_exactly_what_the_allocator_needs_leaves_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK, enable_prefix_caching=True)
    old = request("old", list(range(1, 18)))  # 4 full blocks + 1 token
    compute(kv, old, 17)
    kv.free(old)
    assert kv.num_cached_blocks == 4 and kv.num_free_blocks() == 6
    new = request("new", list(range(100, 112)))
    compute(kv, new, 12)  # 3 blocks: the 2 worthless ones (never used, old's partial), then old's deepest
    assert kv.num_evictions == 1 and kv.num_cached_blocks == 3 + 3
    assert kv.match_prefix(request("again", list(range(1, 18)))).num_tokens == 12
    kv.check_integrity([new])


def test_an_output_block_joins_the_tree_once_filled_and_computed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    r = request("a", [1, 2, 3, 4, 5, 6])
    compute(kv, r, 6)
    r.output_token_ids += [7, 8]  # block 1 is full of known tokens, its last one not computed yet
    compute(kv, r, 1)
    assert kv.match_prefix(request("b", list(range(1, 10)))).sibling_computing
    compute(kv, r, 1)
    assert kv.match_prefix(request("b", list(range(1, 10)))).num_tokens == 8
    kv.check_integrity([r])


def test_a_second_copy_of_cached_tokens_stays_private() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    a = request("a", list(range(1, 10)), prompt_logprobs=1)  # computes everything itself
    b = request("b", list(range(1, 10)), prompt_logprobs=1)
    compute(kv, a, 9)
    compute(kv, b, 9)
    assert kv.num_cached_blocks == 2  # a's blocks only: b's duplicates are not in the tree
    kv.check_integrity([a, b])
    kv.free(b)
    kv.free(a)
    assert kv.pool.num_evictable_blocks == 2
    kv.check_integrity([])


def test_a_fork_child_extends_the_parents_path() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    parent = request("p", list(range(1, 7)))
    compute(kv, parent, 6)
    child = request("c", parent.prompt_token_ids)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    child.output_token_ids += [40, 41]
    compute(kv, child, 1)
    compute(kv, child, 1)
    assert kv.match_prefix(request("x", list(range(1, 7)) + [40, 41, 99])).num_tokens == 8
    kv.check_integrity([parent, child])


def test_a_waiting_request_rematched_after_its_prefix_was_evicted_starts_from_what_is_cached_now() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_prefix_caching=True)
    a = request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a, 9)
    kv.free(a)  # [1..4] and [5..8] cached, evictable
    waiting = request("w", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert kv.match_prefix(waiting).num_tokens == 8  # matched while it waits
    x = request("x", list(range(20, 31)))
    compute(kv, x, 11)  # takes every block: both cached ones evicted, and cached again under x's tokens
    assert kv.num_evictions == 2
    match = kv.match_prefix(waiting)
    assert match.num_tokens == 0
    kv.free(x)
    assert kv.allocate_slots(waiting, waiting.num_tokens, match)
    kv.check_integrity([waiting])


# ---------------------------------------------------------------------------------------------- cache_salt


def salted(request_id: str, prompt: list[int], salt: str | None) -> Request:
    r = request(request_id, prompt)
    r.cache_salt = salt
    return r


def test_a_cache_salt_shares_blocks_only_with_requests_of_the_same_salt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 2 full blocks
    first = salted("a", prompt, "tenant-1")
    compute(kv, first, 10)
    assert kv.match_prefix(salted("b", prompt, "tenant-1")).num_tokens == 8
    assert kv.match_prefix(salted("c", prompt, "tenant-2")).num_tokens == 0
    assert kv.match_prefix(salted("d", prompt, None)).num_tokens == 0
    unsalted = salted("e", prompt, None)
    compute(kv, unsalted, 10)  # its own blocks, under the unsalted root: no duplicate of a's
    assert kv.num_cached_blocks == 4 and kv.match_prefix(salted("f", prompt, None)).num_tokens == 8
    assert kv.match_prefix(salted("g", prompt, "tenant-1")).block_ids == first.block_ids[:2]
    kv.check_integrity([first, unsalted])


def test_a_salts_root_is_kept_only_while_blocks_hang_under_it() -> None:
    """A root per salt ever sent would grow without bound: a salt's root is kept while blocks hang under it,
    and a request whose path names a root not kept adds its blocks under the one kept by then."""
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK, enable_prefix_caching=True)
    cache = kv.prefix_cache
    early = salted("early", [7, 7], "s")  # no full block yet: its path names a root nobody keeps
    compute(kv, early, 2)
    assert cache._namespace_roots == {}
    later = salted("later", [1, 2, 3, 4, 5], "s")
    compute(kv, later, 5)
    kept = cache._namespace_roots[CacheNamespace("s")]
    early.output_token_ids += [8, 8]  # early's first block fills: it hangs under the root kept now
    compute(kv, early, 1)
    compute(kv, early, 1)
    assert set(kept.children) == {(1, 2, 3, 4), (7, 7, 8, 8)}
    assert kv.match_prefix(salted("again", [7, 7, 8, 8, 9], "s")).block_ids == early.block_ids[:1]
    kv.check_integrity([early, later])
    kv.free(early)
    kv.free(later)
    other = salted("other", list(range(20, 44)), None)
    compute(kv, other, 24)  # takes every block: the salt's blocks are evicted, and its root goes with them
    assert cache._namespace_roots == {} and kv.match_prefix(salted("again", [1, 2, 3, 4, 5], "s")).num_tokens == 0
    kv.check_integrity([other])
