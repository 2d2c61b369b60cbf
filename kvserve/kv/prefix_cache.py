"""PrefixCache: a radix tree of token ids over whole KV blocks, so that a shared prefix is computed once.

Every edge is one block's worth of token ids (a radix tree whose keys are compared a block at a time, as a
paged cache must reuse whole blocks), and every node names the block holding that KV::

    root ─[t0..t15]─ b3 ─[t16..t31]─ b9 ─[t32..t47]─ b4        (a system prompt)
                         │                └[u32..u47]─ b12      (a second conversation on it)
                         └[v16..v31]─ b7 (pending)              (being computed by a running request)

Requests sent with a ``cache_salt`` walk a tree of their salt's, under a root of its own, so that only requests
with the same salt share blocks (one tenant cannot learn from the cache's speed what another's prompts were); so
do requests with a LoRA adapter, whose KV differs from the base model's: a root per ``CacheNamespace`` (salt and
adapter). A namespace's root is kept while blocks hang under it: one per tenant or adapter with blocks cached,
not one per salt ever sent.

A node is *pending* while the request that allocated its block has not yet computed it: a request that
arrives with the same prefix sees the pending node and waits for it instead of computing the prefix again.

The tree holds no references: blocks are held by requests (``BlockPool`` counts them). A request holds the
whole path of its blocks, so an unheld node has only unheld descendants, and since a request releases its
blocks tail first, descendants always leave before their ancestors: the pool's evictable queue, oldest first,
only ever evicts leaves. Eviction order is kept by the pool's queue, updated in O(1) per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from kvserve.kv.block_keys import CacheNamespace, namespace_root_key


@dataclass(eq=False)
class PrefixNode:
    key: tuple[int, ...]  # the block's token ids; () at the root
    block_id: int  # -1 at the root
    parent: PrefixNode | None
    computed: bool = True  # False while the owning request has not yet written the block
    children: dict[tuple[int, ...], PrefixNode] = field(default_factory=dict)
    content_key: bytes | None = None  # the block's key in the KV tiers (``block_keys``); None without tiers
    # KV cache groups 1..G-1's blocks of these tokens (``kv/groups.py``), NULL_BLOCK once evicted; [] with one
    # group. They are cached beside the node, not part of the tree's structure: one may be evicted while the
    # node stays, and a match then stops where a group lacks a block its next query would see.
    group_block_ids: list[int] = field(default_factory=list)
    namespace: CacheNamespace | None = None  # a root's: that of the requests whose blocks hang under it

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(frozen=True)
class PrefixMatch:
    """The longest computed cached prefix of some tokens: ``nodes`` in order, one per block, then the content
    keys of the blocks after them that the host KV tier holds (``tiered``: loaded into fresh device blocks).
    (A swapped-out request resumes from its own KV instead: ``SwappedKV``, ``kv/swap.py``.)"""

    nodes: tuple[PrefixNode, ...]
    block_size: int
    sibling_computing: bool = False  # the next block of the prefix is pending: a running request computes it
    tiered: tuple[bytes, ...] = ()
    loading: bool = False  # the next blocks are being read from the disk tier

    @property
    def block_ids(self) -> list[int]:
        """The device blocks of the match (not the tiered ones, which have none yet)."""
        return [node.block_id for node in self.nodes]

    @property
    def num_tokens(self) -> int:
        return (len(self.nodes) + len(self.tiered)) * self.block_size

    @property
    def must_wait(self) -> bool:
        """The prefix goes on beyond the match and will soon be ready: computing it again would be waste."""
        return self.sibling_computing or self.loading


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = PrefixNode(key=(), block_id=-1, parent=None)  # of requests without a cache_salt or adapter
        self._namespace_roots: dict[CacheNamespace, PrefixNode] = {}  # those with blocks under them
        self._by_block: dict[int, PrefixNode] = {}

    @property
    def num_nodes(self) -> int:
        return len(self._by_block)

    def node_of(self, block_id: int) -> PrefixNode | None:
        return self._by_block.get(block_id)

    def root_of(self, namespace: CacheNamespace | None) -> PrefixNode:
        """The root a request of ``namespace`` (``Request.cache_namespace``; None: no salt, no adapter) walks from.
        A namespace's root is new until a block hangs under it (``add``)."""
        if namespace is None:
            return self.root
        root = self._namespace_roots.get(namespace)
        if root is None:
            root = PrefixNode(key=(), block_id=-1, parent=None, namespace=namespace)
            root.content_key = self.content_root(namespace)
        return root

    def content_root(self, namespace: CacheNamespace | None) -> bytes | None:
        """The content key (``block_keys``) the blocks of requests of ``namespace`` chain from; None without
        tiers."""
        root = self.root.content_key
        return root if namespace is None or root is None else namespace_root_key(root, namespace)

    def match(self, token_ids: Sequence[int], max_blocks: int, start: PrefixMatch | None = None,
              namespace: CacheNamespace | None = None) -> PrefixMatch:
        """Walk the tree of ``namespace`` (the requests' salt and adapter) along ``token_ids``, at most ``max_blocks``
        blocks, through computed nodes.

        ``start``, an earlier match of the same tokens, is reused while its last node is still in the tree
        (nodes leave only as leaves, so then all of them are): the walk goes on from there, and a request
        re-matched every step while it waits costs one block's key, not its whole prefix."""
        max_blocks = min(max_blocks, len(token_ids) // self.block_size)
        nodes = list(start.nodes[:max_blocks]) if start is not None and self._is_live(start) else []
        node = nodes[-1] if nodes else self.root_of(namespace)
        for key in self.keys(token_ids, len(nodes), max_blocks - len(nodes)):
            child = node.children.get(key)
            if child is None:
                break
            if not child.computed:
                return PrefixMatch(tuple(nodes), self.block_size, sibling_computing=True)
            nodes.append(child)
            node = child
        return PrefixMatch(tuple(nodes), self.block_size)

    def add(self, parent: PrefixNode, key: tuple[int, ...], block_id: int, computed: bool) -> PrefixNode | None:
        """Hang ``block_id`` under ``parent`` as ``key``; returns None, adding nothing, if ``parent`` already
        has that key (another request computed the same tokens into another block). A namespace's root that
        ``parent`` names is its namespace's root now (kept from here on), or the one kept meanwhile (a path may name
        a root let go, or not yet kept, when its request took no block under it)."""
        if len(key) != self.block_size:
            raise ValueError(f"a key is one block of {self.block_size} tokens, got {len(key)}")
        if block_id in self._by_block:
            raise ValueError(f"block {block_id} is already in the prefix cache")
        if parent.namespace is not None:
            parent = self._namespace_roots.setdefault(parent.namespace, parent)
        if key in parent.children:
            return None
        node = PrefixNode(key, block_id, parent, computed)
        parent.children[key] = node
        self._by_block[block_id] = node
        return node

    def _is_live(self, match: PrefixMatch) -> bool:
        return not match.nodes or self._by_block.get(match.nodes[-1].block_id) is match.nodes[-1]

    def remove(self, block_id: int) -> None:
        """Drop the node of ``block_id``, which must be a leaf (eviction, or an uncomputed block let go)."""
        node = self._by_block[block_id]
        assert not node.children, f"block {block_id} is not a leaf of the prefix cache; it cannot be removed"
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        del self._by_block[block_id]
        if parent.namespace is not None and not parent.children:  # salts come and go: a root per salt ever sent
            del self._namespace_roots[parent.namespace]  # would leak

    def check_roots(self) -> None:
        """Every namespace's root kept has blocks under it and is the root its nodes hang from. Raises
        AssertionError."""
        for namespace, root in self._namespace_roots.items():
            assert root.namespace == namespace and root.children, f"the root of {namespace} is kept with no block"
            assert all(child.parent is root for child in root.children.values()), f"a root of {namespace} is stale"

    def keys(self, token_ids: Sequence[int], first_block: int, num_blocks: int) -> Iterator[tuple[int, ...]]:
        """The keys of blocks ``first_block .. first_block + num_blocks - 1`` of ``token_ids``."""
        size = self.block_size
        for index in range(first_block, first_block + num_blocks):
            yield tuple(token_ids[index * size : (index + 1) * size])

    def nodes(self) -> Iterator[PrefixNode]:
        """Every node but the roots, parents before children."""
        stack = [node for root in (self.root, *self._namespace_roots.values()) for node in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
