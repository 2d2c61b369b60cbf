"""KV cache groups: the layout of layers into groups and tensors, the storage's shared tensors, and the manager's
per-group tables that free the blocks a sliding window has passed."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.block_keys import group_key
from kvserve.kv.groups import NULL_BLOCK, KVCacheGroups
from kvserve.kv.manager import KVCacheManager, NoFreeBlocksError
from kvserve.kv.quant import kv_cache_dtype
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from kvserve.kv.swap import SwappedKV
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.sched.output import KVTransferPlan
from tests.sched.sched_fakes import TransferCounts, apply_kv_transfers, fake_tiers, group_kv

GEMMA3_270M = (["w"] * 5 + [None]) * 3  # 18 layers, five sliding to one full


def request(request_id: str = "r", num_prompt: int = 3) -> Request:
    return Request(request_id, list(range(10, 10 + num_prompt)), SamplingParams())


def test_gemma3_270m_is_one_full_group_and_five_window_groups_of_three_layers() -> None:
    windows = [512 if w == "w" else None for w in GEMMA3_270M]
    groups = KVCacheGroups.of_layers(windows)
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.group_size == 3 and groups.frees_blocks
    assert groups.layers_of(0) == [5, 11, 17]
    assert groups.layers_of(1) == [0, 1, 2] and groups.layers_of(5) == [14, 15, 16]
    for group in range(groups.num_groups):  # each group uses every tensor once
        assert sorted(groups.layer_tensors[layer] for layer in groups.layers_of(group)) == [0, 1, 2]


def test_one_kind_of_layer_is_the_plain_layout() -> None:
    assert KVCacheGroups.of_layers([None] * 4) == KVCacheGroups.single(4)
    mistral = KVCacheGroups.of_layers([12] * 4)
    assert mistral.windows == (12,) and mistral.layer_tensors == (0, 1, 2, 3) and mistral.frees_blocks
    assert not KVCacheGroups.single(4).frees_blocks


def test_a_kind_that_does_not_divide_pads_its_last_group() -> None:
    groups = KVCacheGroups.of_layers([8, 8, 8, 8, 8, None, None])
    assert groups.group_size == 2
    assert groups.windows == (None, 8, 8, 8)
    assert groups.layers_of(3) == [4] and groups.layer_tensors[4] == 0


def test_two_windows_make_two_kinds() -> None:
    groups = KVCacheGroups.of_layers([4, 8, None, 4, 8, None])
    assert groups.windows == (None, 4, 8) and groups.group_size == 2


def test_the_layout_names_the_layers_a_block_of_each_group_holds() -> None:
    """Blocks kept beyond the process (the KV tiers) are keyed by it: blocks of another layout are never used."""
    assert KVCacheGroups.of_layers([8, 8, None, 8, 8, None]).layout == "full:2,5;8:0,1;8:3,4"
    assert KVCacheGroups.of_layers([4, 8, None, 4, 8, None]).layout == "full:2,5;4:0,3;8:1,4"
    assert KVCacheGroups.single(4).layout == KVCacheGroups.of_layers([8] * 4).layout == ""  # every layer a block


# ---------------------------------------------------------------------------------------------------- storage


def spec(layer_tensors: tuple[int, ...], kv_dtype: str = "auto") -> KVCacheSpec:
    return KVCacheSpec(len(layer_tensors), 2, 8, 4, torch.float32, kv_cache_dtype(kv_dtype, torch.float32),
                       layer_tensors=layer_tensors)


def test_layers_of_different_groups_share_tensors_through_their_own_blocks() -> None:
    shared = spec((0, 0, 1))  # layers 0 and 1 in different groups, same tensor
    assert shared.num_tensors == 2 and shared.bytes_per_block == 2 * spec((0, 1, 2)).bytes_per_block // 3
    kv = KVCacheStorage(shared, num_blocks=4, device="cpu")
    assert kv.layer(0).k is kv.layer(1).k and kv.layer(0).k is not kv.layer(2).k
    k0, k1 = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    kv.write(0, torch.arange(4, 8), k0, -k0)  # block 1 through layer 0's group
    kv.write(1, torch.arange(8, 12), k1, -k1)  # block 2 through layer 1's group
    keys, values = kv.layer(0).gather(torch.arange(4, 8))
    assert torch.equal(keys, k0) and torch.equal(values, -k0)
    keys, _ = kv.layer(1).gather(torch.arange(8, 12))
    assert torch.equal(keys, k1)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_blocks_move_and_copy_as_stored_with_shared_tensors(kv_dtype: str) -> None:
    kv = KVCacheStorage(spec((0, 0, 1), kv_dtype), num_blocks=4, device="cpu")
    for layer in range(3):
        k = torch.randn(16, 2, 8)
        kv.write(layer, torch.arange(16), k, k + 1)
    rows = torch.zeros(2, kv.spec.bytes_per_block, dtype=torch.uint8)
    kv.read_blocks([1, 3], rows, [0, 1])
    kv.copy_blocks(((1, 0),))
    other = KVCacheStorage(kv.spec, num_blocks=4, device="cpu")
    other.write_blocks([2, 0], rows, [0, 1])
    for layer in range(3):
        for mine, theirs in zip(kv.layer(layer).tensors(), other.layer(layer).tensors()):
            assert torch.equal(mine[1], theirs[2]) and torch.equal(mine[3], theirs[0])
            assert torch.equal(mine[0], mine[1])


# ---------------------------------------------------------------------------------------------------- manager


def hybrid(num_blocks: int = 32, window: int = 6, block_size: int = 4) -> KVCacheManager:
    """One full group and one window group, as the tiny Gemma 3."""
    return KVCacheManager(num_blocks, block_size, groups=KVCacheGroups.of_layers([window, None]))


def test_every_group_grows_alike_and_the_window_group_frees_what_its_window_passed() -> None:
    kv = hybrid()
    r = request(num_prompt=10)
    assert kv.allocate_slots(r, 10)
    full, window = kv.tables(r)
    assert len(full) == len(window) == 3 and kv.num_free_blocks() == 26
    r.num_computed_tokens = 10  # the next query at 10 sees 5 .. 10: block 0 (0 .. 3) is dead
    assert kv.allocate_slots(r, 1)
    assert window[0] == NULL_BLOCK and window[1:] != [NULL_BLOCK] * 2 and NULL_BLOCK not in full
    assert kv.take_null_counts(r) == (0, 1) and kv.take_null_counts(r) == ()
    assert kv.num_windowed_blocks == 2 and kv.num_free_blocks() == 27
    kv.check_integrity([r])


def test_a_block_the_next_query_still_sees_is_never_freed() -> None:
    window, block_size = 6, 4
    kv = hybrid(window=window, block_size=block_size)
    r = request(num_prompt=1)
    for num_computed in range(0, 60):
        r.num_computed_tokens = num_computed
        assert kv.allocate_slots(r, 1)
        first_visible = max(0, num_computed - window + 1)
        _, table = kv.tables(r)
        live = [i for i, b in enumerate(table) if b != NULL_BLOCK]
        assert live[0] == first_visible // block_size  # every visible block kept, every dead one freed
        assert kv.num_windowed_blocks <= -(-(window - 1) // block_size) + 2
        kv.check_integrity([r])
    kv.free(r)
    assert kv.num_free_blocks() == 32 and kv.num_windowed_blocks == 0
    kv.check_integrity([])


def test_a_chunk_keeps_the_blocks_its_first_query_sees() -> None:
    kv = hybrid(window=6, block_size=4)
    r = request(num_prompt=40)
    assert kv.allocate_slots(r, 16)
    r.num_computed_tokens = 16  # the chunk 16 .. 31: its first query sees 11 .. 16, so block 2 (8 .. 11) lives
    assert kv.allocate_slots(r, 16)
    assert kv.tables(r)[1][:3] == [NULL_BLOCK, NULL_BLOCK, kv.tables(r)[1][2]] and kv.tables(r)[1][2] >= 0


def test_allocation_needs_a_block_for_every_group_or_takes_none() -> None:
    kv = hybrid(num_blocks=5)
    a, b = request("a", 8), request("b", 8)
    assert kv.allocate_slots(a, 8)  # 2 blocks x 2 groups
    assert not kv.allocate_slots(b, 8)  # 4 more needed, 1 free
    assert b.block_ids == [] and kv.num_free_blocks() == 1
    kv.check_integrity([a, b])


def test_fork_shares_every_groups_full_blocks_and_their_nulls_and_copies_each_partial_block() -> None:
    kv = hybrid(window=6, block_size=4)
    parent = request("p", num_prompt=14)
    assert kv.allocate_slots(parent, 13)
    parent.num_computed_tokens = 13
    assert kv.allocate_slots(parent, 1)  # frees the window group's block 0 (the query at 13 sees 8 .. 13)
    child = request("c", num_prompt=14)
    child.num_computed_tokens = 13
    copies = kv.fork(parent, child)
    (p_full, p_window), (c_full, c_window) = kv.tables(parent), kv.tables(child)
    assert c_full[:3] == p_full[:3] and c_window[:3] == p_window[:3] and c_window[0] == NULL_BLOCK
    assert copies == [(p_full[3], c_full[3]), (p_window[3], c_window[3])]
    kv.check_integrity([parent, child])
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks() == 32 and kv.num_windowed_blocks == 0


def test_fork_without_a_block_for_every_group_raises_and_changes_nothing() -> None:
    kv = hybrid(num_blocks=5)
    parent = request("p", num_prompt=6)
    assert kv.allocate_slots(parent, 5)
    parent.num_computed_tokens = 5
    assert kv.allocate_slots(parent, 3)  # 4 blocks held, 1 free; the fork's copies need 2
    child = request("c", num_prompt=6)
    child.num_computed_tokens = 5
    with pytest.raises(NoFreeBlocksError):
        kv.fork(parent, child)
    assert child.block_ids == [] and kv.num_free_blocks() == 1
    kv.check_integrity([parent, child])


def test_free_tail_drops_every_groups_tail() -> None:
    kv = hybrid()
    r = request(num_prompt=3)
    assert kv.allocate_slots(r, 12)
    kv.free_tail(r, 5)
    assert [len(t) for t in kv.tables(r)] == [2, 2] and kv.num_free_blocks() == 28
    kv.check_integrity([r])


def test_the_prefix_cache_needs_one_full_group_to_key_its_tree() -> None:
    for windows in ([6, 6], [6, None, None]):  # no full group; two (group_size 1)
        with pytest.raises(ValueError, match="prefix cache"):
            KVCacheManager(8, 4, enable_prefix_caching=True, groups=KVCacheGroups.of_layers(windows))
    KVCacheManager(8, 4, enable_prefix_caching=True, groups=KVCacheGroups.of_layers([6, None]))
    KVCacheManager(8, 4, enable_prefix_caching=True, groups=KVCacheGroups.single(2))  # the fallback layout


def test_a_request_that_could_hold_more_blocks_than_the_pool_is_counted_over_its_groups() -> None:
    kv = hybrid(window=6, block_size=4)
    # 100 tokens: the full group 25 blocks, the window group at most (6 - 1 + 8) // 4 + 2 = 5 in chunks of 8
    assert kv.max_blocks_for(100, max_chunk=8) == 25 + 5
    assert KVCacheManager(8, 4).max_blocks_for(100, max_chunk=8) == 25


# ------------------------------------------------------------------------------------------- the prefix cache


def cached_hybrid(num_blocks: int = 40, window: int = 6) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, enable_prefix_caching=True, groups=KVCacheGroups.of_layers([window, None]))


def run_to(kv: KVCacheManager, r: Request, num_tokens: int) -> None:
    """Compute the request's tokens one step at a time (a prompt chunk, then decodes), as the scheduler does."""
    while r.num_computed_tokens < num_tokens:
        num_new = r.num_prompt_tokens - r.num_computed_tokens if r.num_computed_tokens == 0 else 1
        assert kv.allocate_slots(r, num_new)
        r.num_computed_tokens += num_new
        if r.num_computed_tokens > r.num_prompt_tokens:
            r.output_token_ids.append(99)
        kv.cache_computed(r)


def visible_length(kv: KVCacheManager, nodes) -> int:
    """The oracle: the longest k such that the window group kept the blocks holding the keys the query at
    k * block_size sees (positions k * block_size - w + 1 .. k * block_size - 1)."""
    window = kv.groups.windows[1]
    for k in reversed(range(len(nodes) + 1)):
        positions = range(max(0, k * kv.block_size - window + 1), k * kv.block_size)
        if all(nodes[p // kv.block_size].group_block_ids[0] != NULL_BLOCK for p in positions):
            return k
    return 0


def test_a_hit_takes_every_groups_blocks_its_next_query_sees() -> None:
    kv = cached_hybrid()
    a = request("a", num_prompt=24)
    run_to(kv, a, 24)
    a_full, a_window = (list(t) for t in kv.tables(a))
    run_to(kv, a, 30)  # its window group drops blocks 0 .. 5: cached, so evictable
    assert kv.tables(a)[1][:6] == [NULL_BLOCK] * 6
    kv.free(a)
    kv.check_integrity([])
    b = request("b", num_prompt=26)
    b.prompt_token_ids[:24] = a.prompt_token_ids
    match = kv.match_prefix(b)
    assert len(match.nodes) == 6  # the query at 24 sees 19 .. 24: blocks 4 and 5 of the window group
    assert kv.allocate_slots(b, 2, match)
    full, window = kv.tables(b)
    assert full[:6] == a_full[:6] and window[:6] == [NULL_BLOCK] * 4 + a_window[4:6]
    assert kv.num_windowed_blocks == 3
    kv.check_integrity([b])


def test_a_match_stops_where_a_window_block_it_needs_was_evicted() -> None:
    kv = cached_hybrid(num_blocks=40)
    a = request("a", num_prompt=24)
    run_to(kv, a, 30)
    nodes = kv.match_prefix(a).nodes
    kv.free(a)
    lost = nodes[5].group_block_ids[0]
    order = kv.pool.evictable_order()
    kv.pool.allocate(kv.pool.num_free_blocks - kv.pool.num_evictable_blocks + order.index(lost) + 1)  # evicts up to it
    assert nodes[5].group_block_ids[0] == NULL_BLOCK and kv.prefix_cache.node_of(nodes[5].block_id) is nodes[5]
    b = request("b", num_prompt=26)
    b.prompt_token_ids[:24] = a.prompt_token_ids
    match = kv.match_prefix(b)
    assert len(match.nodes) == visible_length(kv, nodes[:6]) < 6


def test_an_evicted_node_lets_go_of_its_group_blocks() -> None:
    kv = cached_hybrid(num_blocks=12)
    a = request("a", num_prompt=8)
    run_to(kv, a, 8)
    kv.free(a)
    assert kv.num_cached_blocks == 4 and kv.pool.num_evictable_blocks == 4  # two nodes, each with a window block
    kv.pool.allocate(kv.pool.num_free_blocks)  # evicts every cached block
    assert kv.prefix_cache.num_nodes == 0 and kv.num_cached_blocks == 0
    kv.pool.check_integrity()


def test_visible_length_cuts_a_prefix_back_to_where_its_query_sees_only_blocks_still_there() -> None:
    groups = KVCacheGroups.of_layers([6, None])  # block_size 4: the query at 4k sees keys 4k - 5 .. 4k

    def length(missing: set[int]) -> int:
        return groups.visible_length(8, 4, lambda g, index: index not in missing)

    assert length(set()) == length({0, 1, 2, 3, 4, 5}) == 8  # the query at 32 sees blocks 6 and 7 only
    assert length({6}) == 6  # then the query at 24 sees blocks 4 and 5
    assert length({6, 5}) == 5 and length({6, 5, 3}) == 3 and length({0}) == 8


def test_visible_entries_are_every_groups_blocks_from_the_first_its_next_query_sees() -> None:
    groups = KVCacheGroups.of_layers([6, None])  # the query at 14 sees keys 9 .. 14: window blocks 2 and 3
    tables = [[10, 11, 12, 13], [NULL_BLOCK, 21, 22, 23]]
    assert groups.visible_entries(tables, 14, 4) == [(0, 0, 10), (0, 1, 11), (0, 2, 12), (0, 3, 13),
                                                     (1, 2, 22), (1, 3, 23)]
    assert groups.visible_entries(tables, 8, 4) == [(0, 0, 10), (0, 1, 11), (1, 0, NULL_BLOCK), (1, 1, 21)]


# ----------------------------------------------------------------------------------- swap and the KV tiers


def tiered_hybrid(num_blocks: int = 40, prefix_caching: bool = True, disk_dir: str | None = None) -> KVCacheManager:
    """The hybrid layout over a host tier (and a disk tier) of fake blocks of token ids."""
    groups = KVCacheGroups.of_layers([6, None])
    return KVCacheManager(num_blocks, 4, prefix_caching, fake_tiers(4, 64, disk_dir, groups.layout), groups)


def fake_cache(kv: KVCacheManager) -> list[list[int | None]]:
    return [[None] * kv.block_size for _ in range(kv.num_blocks_total)]


def apply_plan(kv: KVCacheManager, cache: list[list[int | None]]) -> KVTransferPlan:
    """The tier transfers planned since the last step, applied to the fake cache as the runner applies them."""
    plan = KVTransferPlan((), *kv.take_tier_transfers())
    apply_kv_transfers(cache, kv.store, plan, TransferCounts())
    return plan


def compute_to(kv: KVCacheManager, cache: list[list[int | None]], r: Request, num_tokens: int) -> None:
    """Step the request to ``num_tokens`` computed tokens (its prompt in one chunk, then decodes), as the scheduler
    and the runner do: blocks allocated, the plan applied, each group's fake KV written, a token sampled."""
    while r.num_computed_tokens < num_tokens:
        start = r.num_computed_tokens
        assert kv.allocate_slots(r, r.num_tokens - start)
        apply_plan(kv, cache)
        for group, table in enumerate(kv.tables(r)):
            for pos in range(start, r.num_tokens):
                cache[table[pos // kv.block_size]][pos % kv.block_size] = group_kv(group, r.token_ids[pos])
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(99)
        kv.cache_computed(r)


def assert_sees_its_kv(kv: KVCacheManager, cache: list[list[int | None]], r: Request) -> None:
    """Every key the request's next query sees holds its token's KV, in every group's table."""
    for group, table in enumerate(kv.tables(r)):
        first = kv.groups.first_visible_block(group, r.num_computed_tokens, kv.block_size) * kv.block_size
        for pos in range(first, r.num_computed_tokens):
            slot = cache[table[pos // kv.block_size]][pos % kv.block_size]
            assert slot == group_kv(group, r.token_ids[pos]), f"group {group}: stale KV at {pos}"


@pytest.mark.parametrize(("num_tokens", "first", "num_rows"), [
    (14, 2, 4 + 2),  # the query at 14 sees 9 .. 14: window blocks 2 and 3, none freed yet
    (17, 3, 5 + 2),  # at 17 it sees 12 .. 17: blocks 3 and 4 (0 and 1 freed, block 2 dead but still held)
])
def test_swap_keeps_every_groups_blocks_that_the_next_query_sees_and_brings_them_back(
    num_tokens: int, first: int, num_rows: int
) -> None:
    kv = tiered_hybrid(prefix_caching=False)
    cache, r = fake_cache(kv), request(num_prompt=14)
    compute_to(kv, cache, r, num_tokens)
    assert kv.swap_out(r)
    assert kv.swap.counters.num_blocks_swapped_out == num_rows == 64 - len(kv.store.host._free)  # rows held
    assert kv.tables(r) == [[]] and kv.num_free_blocks() == 40 and kv.num_windowed_blocks == 0
    kv.check_integrity([r])
    apply_plan(kv, cache)
    cache[:] = fake_cache(kv)  # every freed block reused and overwritten
    match = kv.match_prefix(r)
    assert match == SwappedKV(num_tokens) and kv.allocate_slots(r, 1, match)
    assert len(apply_plan(kv, cache).swap_ins) == num_rows
    full, window = kv.tables(r)
    assert len(full) == len(window) == -(-(num_tokens + 1) // 4) and window[:first] == [NULL_BLOCK] * first
    assert NULL_BLOCK not in window[first:] and kv.num_windowed_blocks == len(window) - first
    assert_sees_its_kv(kv, cache, r)
    kv.check_integrity([r])


def test_a_swap_in_takes_back_every_groups_blocks_the_prefix_tree_still_holds() -> None:
    kv = tiered_hybrid()
    cache, r = fake_cache(kv), request(num_prompt=16)
    compute_to(kv, cache, r, 18)  # blocks 0 .. 3 on the tree; the query at 18 sees 13 .. 18: window blocks 3, 4
    assert kv.swap_out(r)
    apply_plan(kv, cache)
    assert kv.allocate_slots(r, 1, kv.match_prefix(r))
    swap = kv.swap.counters
    assert (swap.num_blocks_found_on_device, swap.num_blocks_swapped_in) == (4 + 1, 1 + 1)  # the partial block 4
    apply_plan(kv, cache)
    assert_sees_its_kv(kv, cache, r)
    kv.check_integrity([r])


def test_every_groups_block_of_an_evicted_node_goes_to_the_host_tier_under_its_own_key() -> None:
    kv = tiered_hybrid()
    cache, r = fake_cache(kv), request(num_prompt=8)
    compute_to(kv, cache, r, 8)
    nodes = kv.match_prefix(request("again", num_prompt=9)).nodes
    kv.free(r)
    kv.pool.allocate(kv.pool.num_free_blocks)  # evicts every cached block
    offloads = apply_plan(kv, cache).offloads
    host = kv.store.host
    keys = {group_key(node.content_key, group): group for node in nodes for group in (0, 1)}
    assert sorted(row for _, row in offloads) == sorted(host.row(key) for key in keys)
    assert host.other_groups == {key for key, group in keys.items() if group == 1}


def test_a_prefix_evicted_from_the_device_comes_back_with_the_window_blocks_its_query_sees() -> None:
    kv = tiered_hybrid()
    cache, a = fake_cache(kv), request("a", num_prompt=24)
    compute_to(kv, cache, a, 30)  # the window group freed blocks 0 .. 5 while decoding: cached, evictable
    kv.free(a)
    kv.pool.free(kv.pool.allocate(kv.pool.num_free_blocks))  # every cached block evicted to the host tier
    apply_plan(kv, cache)
    cache[:] = fake_cache(kv)
    b = request("b", num_prompt=26)
    b.prompt_token_ids[:24] = a.prompt_token_ids
    match = kv.match_prefix(b)
    assert not match.nodes and len(match.tiered) == 6
    assert kv.allocate_slots(b, 2, match)
    b.num_computed_tokens = 24
    # group 0's six blocks and the window group's blocks 4 and 5 (the query at 24 sees 19 .. 24)
    assert len(apply_plan(kv, cache).loads) == 6 + 2 and kv.tables(b)[1][:4] == [NULL_BLOCK] * 4
    assert kv.store.counters.host_hit_tokens == 24  # group 0's blocks count the tokens
    assert_sees_its_kv(kv, cache, b)
    kv.check_integrity([b])


def test_a_window_block_evicted_alone_is_loaded_from_the_host_tier_instead_of_cutting_the_match() -> None:
    kv = tiered_hybrid()
    cache, a = fake_cache(kv), request("a", num_prompt=24)
    compute_to(kv, cache, a, 30)
    nodes = kv.match_prefix(a).nodes
    kv.free(a)
    lost = nodes[5].group_block_ids[0]
    order = kv.pool.evictable_order()
    kv.pool.free(kv.pool.allocate(kv.pool.num_free_blocks - kv.pool.num_evictable_blocks + order.index(lost) + 1))
    apply_plan(kv, cache)
    assert nodes[5].group_block_ids[0] == NULL_BLOCK and kv.prefix_cache.node_of(nodes[5].block_id) is nodes[5]
    b = request("b", num_prompt=26)
    b.prompt_token_ids[:24] = a.prompt_token_ids
    match = kv.match_prefix(b)
    assert len(match.nodes) == 6 and not match.tiered
    lost = [index for index in (4, 5) if nodes[index].group_block_ids[0] == NULL_BLOCK]  # seen by the query at 24
    assert kv.allocate_slots(b, 2, match)
    b.num_computed_tokens = 24
    loads = apply_plan(kv, cache).loads
    assert loads == tuple((kv.store.host.row(group_key(nodes[i].content_key, 1)), kv.tables(b)[1][i]) for i in lost)
    assert kv.store.counters.host_hit_tokens == 0  # the tokens were a hit on the device
    assert_sees_its_kv(kv, cache, b)
    kv.check_integrity([b])


def test_a_restarted_manager_restores_a_prefix_with_its_window_blocks_from_disk(tmp_path) -> None:
    first = tiered_hybrid(disk_dir=str(tmp_path))
    cache, a = fake_cache(first), request("a", num_prompt=24)
    compute_to(first, cache, a, 26)  # every group's blocks written through as they are computed
    first.free(a)
    apply_plan(first, cache)
    first.store.flush()
    b = request("b", num_prompt=26)
    b.prompt_token_ids[:24] = a.prompt_token_ids
    plain = KVCacheManager(40, 4, True, fake_tiers(4, 64, str(tmp_path)))  # another layout: none of its files
    assert plain.match_prefix(b).num_tokens == 0 and not plain.match_prefix(b).loading
    restarted = tiered_hybrid(disk_dir=str(tmp_path))
    cache = fake_cache(restarted)
    assert restarted.match_prefix(b).loading  # read into the host tier meanwhile
    restarted.store.flush()
    match = restarted.match_prefix(b)
    assert len(match.tiered) == 6 and not match.loading and restarted.allocate_slots(b, 2, match)
    b.num_computed_tokens = 24
    assert len(apply_plan(restarted, cache).loads) == 6 + 2
    assert restarted.store.counters.disk_hit_tokens == 24
    assert_sees_its_kv(restarted, cache, b)
    assert restarted.store.counters.corrupt_blocks == 0


def test_window_blocks_read_for_a_waiting_request_are_kept_from_other_requests_offloads(tmp_path) -> None:
    """A prefix on disk read into a host tier of 12 rows for a waiting request: group 0's six blocks and the window
    group's blocks 4 and 5. Another request's write-through offloads took the least recently used rows not kept:
    the window blocks (only group 0's were kept), which cut the match to nothing, and were read again."""
    first = tiered_hybrid(disk_dir=str(tmp_path))
    cache, a = fake_cache(first), request("a", num_prompt=24)
    compute_to(first, cache, a, 26)
    first.free(a)
    apply_plan(first, cache)
    first.store.flush()
    groups = KVCacheGroups.of_layers([6, None])
    kv = KVCacheManager(40, 4, True, fake_tiers(4, 12, str(tmp_path), groups.layout), groups)
    cache = fake_cache(kv)
    b = request("b", num_prompt=26)
    b.prompt_token_ids[:24] = a.prompt_token_ids
    assert kv.match_prefix(b).loading
    kv.store.flush()
    assert kv.store.counters.disk_reads == 6 + 2
    c = Request("c", list(range(1000, 1012)), SamplingParams())  # runs while b waits: six blocks written through
    compute_to(kv, cache, c, 12)
    apply_plan(kv, cache)
    match = kv.match_prefix(b)
    assert len(match.tiered) == 6 and not match.loading and kv.store.counters.disk_reads == 6 + 2
    assert kv.store.counters.blocks_offloaded == 4 and kv.store.counters.blocks_dropped == 2  # 4 rows were free
    assert kv.allocate_slots(b, 2, match)
    b.num_computed_tokens = 24
    assert len(apply_plan(kv, cache).loads) == 6 + 2
    assert_sees_its_kv(kv, cache, b)
    kv.check_integrity([b, c])


def test_the_tiers_must_keep_blocks_of_the_caches_layout() -> None:
    with pytest.raises(ValueError, match="layout"):
        KVCacheManager(8, 4, True, fake_tiers(4, 8), KVCacheGroups.of_layers([6, None]))
