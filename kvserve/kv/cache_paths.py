"""CachePaths: each request's path on the prefix tree, and the other groups' blocks cached beside its nodes.

With prefix caching on, each request walks a path of the tree (``_CachePath``) as its blocks fill::

    request.block_ids:  | b3 | b9 | b4 | b6 | b8 |
    tree path:          | b3 | b9 | b4 | b6 |          b3..b4 computed, b6 pending (this step computes it);
                                                      b8 not full of known tokens yet

A block joins the tree as soon as all its token ids are known (prompt blocks when allocated, output blocks
when filled), pending until computed, so that requests arriving with the same prefix wait for it rather
than compute it again. If another block already holds the same tokens, the request leaves the tree there
("detached"): its later blocks stay private, so a cached node's ancestors are always cached and held.

With KV cache groups (``kv/groups.py``) the tree is keyed by group 0, the model's one full-attention group: its
nodes are held and evicted as with one group. A node also records the other groups' blocks of its tokens
(``PrefixNode.group_block_ids``), cached beside it: a request that frees one (dead to it, or at its end) leaves it
evictable, and it may be evicted alone (``on_evict`` detaches it from its node).

With the KV tiers, a node is keyed by its content too (``block_keys.block_key``, chained from the store's root
key), and every computed block goes to the ``TierPlan`` as an offer when computed and when evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvserve.kv.block_keys import block_key
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.groups import NULL_BLOCK
from kvserve.kv.prefix_cache import PrefixCache, PrefixNode
from kvserve.kv.tier_plan import TierPlan
from kvserve.request import Request


@dataclass
class _CachePath:
    """How far a request's blocks lie on the prefix tree."""

    node: PrefixNode  # the deepest node of the request's path (the root before any)
    num_blocks: int  # the request's leading blocks on the path: node's depth
    pending: list[PrefixNode] = field(default_factory=list)  # the path's uncomputed tail, in order
    detached: bool = False  # another block holds one of its keys: no later block of it joins the tree


class CachePaths:
    """The only writer of the prefix tree: owns every request's path on it and which node each group block cached
    beside a node belongs to. Without a prefix cache no request has a path. The pool's blocks stay the
    ``KVCacheManager``'s: this marks and unmarks them cached, and learns of their evictions (``on_evict``)."""

    def __init__(self, pool: BlockPool, block_size: int, prefix_cache: PrefixCache | None,
                 tier_plan: TierPlan | None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.tier_plan = tier_plan
        self._paths: dict[str, _CachePath] = {}
        self._group_owner: dict[int, tuple[PrefixNode, int]] = {}  # a cached block of groups 1.. -> node, index
        self.num_evictions = 0  # cached blocks evicted to make room, since start
        if prefix_cache is not None and tier_plan is not None:
            prefix_cache.root.content_key = tier_plan.store.root_key

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache names (held or evictable), every group's."""
        return self.prefix_cache.num_nodes + len(self._group_owner) if self.prefix_cache else 0

    def num_path_blocks(self, request_id: str) -> int:
        """The request's leading blocks on the tree (0 for one with no path)."""
        path = self._paths.get(request_id)
        return 0 if path is None else path.num_blocks

    def start(self, request: Request, matched: Sequence[PrefixNode], num_computed: int) -> None:
        """A request that has just taken its blocks, starting from ``matched`` (computed nodes of the tree, leading
        its table): its path runs through them, then on over its blocks of known tokens (``extend``)."""
        if matched:
            self._paths[request.request_id] = _CachePath(matched[-1], len(matched))
        self.extend(request, num_computed)

    def fork(self, parent: Request, child: Request) -> None:
        """The child walks the parent's path through the full blocks it shares: their computed nodes, and those of
        blocks loaded from the KV tiers in this step (pending on the parent's path until its step is back); not the
        node of the partly filled block, which the child gets a copy of."""
        parent_path = self._paths.get(parent.request_id)
        if parent_path is None:
            return
        num_shared = min(parent_path.num_blocks, parent.num_computed_tokens // self.block_size)
        node = parent_path.node
        for _ in range(parent_path.num_blocks - num_shared):
            assert node.parent is not None
            node = node.parent
        self._paths[child.request_id] = _CachePath(node, num_shared, detached=parent_path.detached)

    def extend(self, request: Request, num_computed: int) -> None:
        """Hang the request's blocks whose token ids are all known on its tree path, pending unless computed."""
        path = self._paths.get(request.request_id)
        num_known = min(len(request.block_ids), request.num_tokens // self.block_size)
        if self.prefix_cache is None or (path is not None and (path.detached or path.num_blocks >= num_known)):
            return  # the common decode step ends here: no block newly filled with known tokens
        if path is None:
            path = self._paths[request.request_id] = _CachePath(self.prefix_cache.root_of(request.cache_namespace), 0)
        if path.num_blocks >= num_known:
            return
        keys = self.prefix_cache.keys(request.token_ids, path.num_blocks, num_known - path.num_blocks)
        for index, key in enumerate(keys, start=path.num_blocks):
            block_id = request.block_ids[index]
            computed = index < num_computed // self.block_size
            node = self.prefix_cache.add(path.node, key, block_id, computed)
            if node is None:
                path.detached = True
                return
            self.pool.mark_cached(block_id)
            if request.group_block_ids:
                self._cache_group_blocks(node, request, index)
            if self.tier_plan is not None:
                assert path.node.content_key is not None
                node.content_key = block_key(path.node.content_key, key)
            if not computed:
                path.pending.append(node)
            elif self.tier_plan is not None:
                self.tier_plan.offer(node, evicted=False)
            path.node, path.num_blocks = node, index + 1

    def cache_computed(self, request: Request) -> None:
        """After a step: the request's blocks now computed stop being pending, and blocks it has just filled
        with known tokens (outputs) join the tree."""
        path = self._paths.get(request.request_id)
        if path is None or (not path.pending and request.num_tokens // self.block_size <= path.num_blocks):
            return  # nothing pending, no block newly filled with known tokens
        num_full = request.num_computed_tokens // self.block_size
        first_pending = path.num_blocks - len(path.pending)
        num_done = min(len(path.pending), max(0, num_full - first_pending))
        for node in path.pending[:num_done]:
            node.computed = True
            if self.tier_plan is not None:
                self.tier_plan.offer(node, evicted=False)
        del path.pending[:num_done]
        self.extend(request, request.num_computed_tokens)

    def drop(self, request: Request) -> None:
        """The request is letting go of its blocks (while still holding them): its path ends, its pending nodes
        leave the tree (its computed ones stay, evictable once no request holds them)."""
        path = self._paths.pop(request.request_id, None)
        if path is not None:
            for node in reversed(path.pending):
                self._uncache(node.block_id)

    def on_evict(self, block_id: int) -> None:
        """The pool evicted a cached block (``BlockPool.on_evict``): a node's block leaves the tree with the group
        blocks beside it; a group block alone leaves its node, which stays. Either is offered to the tiers."""
        assert self.prefix_cache is not None
        owner = self._group_owner.pop(block_id, None)
        if owner is not None:
            node, index = owner
            if self.tier_plan is not None:
                self.tier_plan.offer_block(node, index + 1, block_id, evicted=True)
            node.group_block_ids[index] = NULL_BLOCK
            self.num_evictions += 1
            return
        node = self.prefix_cache.node_of(block_id)
        assert node is not None
        if self.tier_plan is not None:
            self.tier_plan.offer(node, evicted=True)
        self.prefix_cache.remove(block_id)
        self._drop_group_blocks(node)
        self.num_evictions += 1

    def drop_unheld(self) -> None:
        """Let go of every cached block no request holds (``KVCacheManager.reset_prefix_cache``): a node's block
        leaves the tree with the group blocks beside it, a group block alone leaves its node; their content is
        worthless now, offered to no tier, and not counted as evicted. The evictable queue lists children before
        their parents, so each node is a leaf when its turn comes."""
        assert self.prefix_cache is not None
        for block_id in self.pool.evictable_order():
            if not self.pool.is_cached(block_id):  # a group block already dropped with its node
                continue
            owner = self._group_owner.pop(block_id, None)
            if owner is not None:
                node, index = owner
                node.group_block_ids[index] = NULL_BLOCK
            else:
                node = self.prefix_cache.node_of(block_id)
                assert node is not None
                self.prefix_cache.remove(block_id)
                self._drop_group_blocks(node)
            self.pool.drop_cached(block_id)

    def _cache_group_blocks(self, node: PrefixNode, request: Request, index: int) -> None:
        """Record the other groups' blocks of a new node (a request's own blocks: never another node's)."""
        node.group_block_ids = [table[index] for table in request.group_block_ids]
        for g, block_id in enumerate(node.group_block_ids):
            if block_id != NULL_BLOCK:
                assert block_id not in self._group_owner, f"block {block_id} is already beside a node"
                self.pool.mark_cached(block_id)
                self._group_owner[block_id] = (node, g)

    def _drop_group_blocks(self, node: PrefixNode) -> None:
        """A node left the tree: the group blocks beside it are worthless once unheld."""
        for block_id in node.group_block_ids:
            if block_id == NULL_BLOCK:
                continue
            del self._group_owner[block_id]
            if self.pool.ref_count(block_id):
                self.pool.unmark_cached(block_id)
            else:
                self.pool.drop_cached(block_id)

    def _uncache(self, block_id: int) -> None:
        assert self.prefix_cache is not None
        node = self.prefix_cache.node_of(block_id)
        assert node is not None
        self.prefix_cache.remove(block_id)
        self.pool.unmark_cached(block_id)
        self._drop_group_blocks(node)

    def check(self, requests: list[Request]) -> None:
        """The prefix tree agrees with the pool (the blocks it names are the cached ones; none held while an
        ancestor is not, none evicted before its parent) and with the requests' paths (the live requests' pending
        tails are the uncomputed nodes; a path runs through its request's leading blocks). ``requests`` are every
        live request holding blocks. Raises AssertionError."""
        if self.prefix_cache is None:
            return
        self.prefix_cache.check_roots()
        nodes = list(self.prefix_cache.nodes())
        self._check_cached_blocks(nodes)
        self._check_evict_order(nodes)
        self._check_paths(nodes, {request.request_id: request for request in requests})

    def _check_cached_blocks(self, nodes: list[PrefixNode]) -> None:
        assert self.prefix_cache is not None
        tree_blocks = {node.block_id for node in nodes}
        assert len(tree_blocks) == len(nodes) == self.prefix_cache.num_nodes, "a block is in the tree twice"
        owners = {b: (node, g) for node in nodes for g, b in enumerate(node.group_block_ids) if b != NULL_BLOCK}
        assert owners.keys() == self._group_owner.keys() and all(
            self._group_owner[b][0] is node and self._group_owner[b][1] == g for b, (node, g) in owners.items()
        ), "the nodes' group blocks and their owners disagree"
        assert not owners.keys() & tree_blocks, "a block is in the tree and beside a node"
        tree_blocks |= owners.keys()
        cached = {b for b in range(self.pool.num_blocks) if self.pool.is_cached(b)}
        assert cached == tree_blocks, f"cached in the pool but not in the tree, or back: {cached ^ tree_blocks}"

    def _check_evict_order(self, nodes: list[PrefixNode]) -> None:
        evict_rank = {b: rank for rank, b in enumerate(self.pool.evictable_order())}
        for node in nodes:
            parent = node.parent
            assert parent is not None
            if not parent.is_root and node.block_id not in evict_rank:  # held: so is every ancestor
                assert parent.block_id not in evict_rank, f"block {node.block_id} is held, its parent is not"
            if not parent.is_root and node.block_id in evict_rank and parent.block_id in evict_rank:
                assert evict_rank[node.block_id] < evict_rank[parent.block_id], (
                    f"block {parent.block_id} would be evicted before its child {node.block_id}"
                )

    def _check_paths(self, nodes: list[PrefixNode], live: dict[str, Request]) -> None:
        pending = [node for node in nodes if not node.computed]
        owned = [node for rid, path in self._paths.items() if rid in live for node in path.pending]
        assert {id(n) for n in pending} == {id(n) for n in owned} and len(owned) == len(pending), (
            "pending nodes and the live requests' pending tails disagree"
        )
        for request_id, path in self._paths.items():
            request = live.get(request_id)
            assert request is not None, f"request {request_id} has a tree path but holds no blocks"
            node = path.node
            for index in reversed(range(path.num_blocks)):
                assert node.block_id == request.block_ids[index], (
                    f"request {request_id}'s block {index} is not on its tree path"
                )
                assert node.parent is not None
                node = node.parent
            assert node.is_root, f"request {request_id}'s tree path is deeper than it says"
            assert node.namespace == request.cache_namespace, \
                f"request {request_id}'s tree path is under another namespace's root (salt or adapter)"
