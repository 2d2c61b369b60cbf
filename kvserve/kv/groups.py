"""KV cache groups: layers that share one block table per request because they see the same keys.

A full-attention layer needs every key of a request; a sliding-window layer of window w only the last w, so
the blocks wholly before its window are dead to it and can go back to the pool while decoding goes on. Layers
are therefore split by window into groups, each with its own block table per request (vLLM v1's hybrid
allocator). All groups draw block ids from one pool, and a block id is ``group_size`` layers' worth of memory:
the storage keeps ``group_size`` paged tensors and layer L reads and writes tensor ``layer_tensors[L]`` at the
rows its group's table names. Memory a window group frees is then reusable by any group::

    layers (Gemma 3 270M: 5 sliding, 1 full, x3)   groups (group_size 3)             a request's tables
    S S S S S F S S S S S F S S S S S F            g0 full:   F F F (tensors 0, 1, 2)  | b3 | b9 | b4 | b6 |
                                                   g1 window: S S S (layers 0, 1, 2)   | -1 | -1 | b2 | b8 |
                                                   ... g5 window: layers 14, 15, 16    (dead blocks: NULL_BLOCK)

Each window (None = full) is a kind; each kind's layers are cut into groups of ``group_size`` layers, the
smallest kind's layer count (the last group of a kind may have fewer layers: its other tensors go unused). A
model whose layers are all one kind is one group with every layer in a tensor of its own: the plain layout. Group 0
is a full group when the model has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

# A block-table entry whose block was freed because no future query of the request can see it. No reader
# dereferences it: attention starts at the first key a query's window shows, which lies past every null entry.
NULL_BLOCK = -1


@dataclass(frozen=True)
class KVCacheGroups:
    """Which group and which paged tensor of a block every layer uses, and each group's window."""

    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: full attention)
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_tensors: tuple[int, ...]  # per layer: the paged tensor it uses, 0 .. group_size - 1

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVCacheGroups:
        """Every layer in one group, in a tensor of its own (the plain layout); ``window`` None keeps every block
        while the request lives."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def of_layers(cls, layer_windows: Sequence[int | None]) -> KVCacheGroups:
        """Groups for layers with these windows (module docstring)."""
        kinds = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
        if len(kinds) == 1:
            return cls.single(len(layer_windows), kinds[0])
        by_kind = {kind: [layer for layer, w in enumerate(layer_windows) if w == kind] for kind in kinds}
        group_size = min(len(layers) for layers in by_kind.values())
        windows: list[int | None] = []
        layer_groups, layer_tensors = [0] * len(layer_windows), [0] * len(layer_windows)
        for kind, layers in by_kind.items():
            for start in range(0, len(layers), group_size):
                for tensor, layer in enumerate(layers[start : start + group_size]):
                    layer_groups[layer], layer_tensors[layer] = len(windows), tensor
                windows.append(kind)
        return cls(tuple(windows), tuple(layer_groups), tuple(layer_tensors))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers' worth of memory in one block: the paged tensors the storage keeps."""
        return max(self.layer_tensors) + 1

    @property
    def keys_prefix_tree(self) -> bool:
        """Whether the prefix tree can be keyed by group 0's blocks: it is the only full-attention group, so no
        request ever frees a block of it before finishing (the tree's nodes stay held while a descendant is)."""
        return self.windows[0] is None and self.windows.count(None) == 1

    @property
    def frees_blocks(self) -> bool:
        """Whether some group drops the blocks its window has passed."""
        return any(w is not None for w in self.windows)

    @property
    def layout(self) -> str:
        """What a block of each group holds, for blocks kept beyond this process (the KV tiers' keys and files):
        '' for one group, every layer in each block (the plain layout, whatever its window); else each group's
        window and layers in tensor order, e.g. ``full:5,11,17;512:0,1,2;...``."""
        if self.num_groups == 1:
            return ""
        return ";".join(f"{'full' if w is None else w}:{','.join(map(str, self.layers_of(g)))}"
                        for g, w in enumerate(self.windows))

    def first_visible_block(self, group: int, position: int, block_size: int) -> int:
        """The first block of the group's table that a query at ``position`` sees (key ``position - w + 1``);
        the blocks before it are dead to the request from that query on."""
        window = self.windows[group]
        return 0 if window is None else max(0, (position - window + 1) // block_size)

    def visible_entries(self, tables: Sequence[Sequence[int]], num_tokens: int,
                        block_size: int) -> list[tuple[int, int, int]]:
        """(group, index, table entry) of every block holding KV of the first ``num_tokens`` tokens that the query
        at ``num_tokens`` sees: group after group, each from its first visible block (what a swap keeps, in the
        order of its host rows)::

            num_tokens 14, block_size 4, w = 6 (the query at 14 sees 9 .. 14):
            group 0:       | b0 | b1 | b2 | b3 |   -> indices 0 .. 3 (a swap's host rows 0 .. 3)
            window group:  | -1 | b5 | b6 | b7 |   -> indices 2 .. 3 (b6, b7: rows 4 .. 5); b5 is dead to the query
        """
        num_blocks = -(-num_tokens // block_size)
        return [(group, index, table[index]) for group, table in enumerate(tables)
                for index in range(self.first_visible_block(group, num_tokens, block_size), num_blocks)]

    def visible_length(self, num_blocks: int, block_size: int, has: Callable[[int, int], bool]) -> int:
        """The longest k <= ``num_blocks`` such that the query at k * block_size finds every block it sees in
        every window group (``has(group, index)``): how much of a cached prefix a request can start from. A
        missing block j cuts k to at most j, as every longer prefix whose window reaches back to j needs it: one
        walk back per cut, each over a window's blocks."""
        k = num_blocks
        while k > 0:
            lost = self._last_lost_block(k, block_size, has)
            if lost is None:
                break
            k = lost
        return k

    def _last_lost_block(self, k: int, block_size: int, has: Callable[[int, int], bool]) -> int | None:
        """The last of blocks 0 .. k - 1 that a window group needs after a prefix of k blocks but lacks, or None."""
        firsts = [(g, self.first_visible_block(g, k * block_size, block_size))
                  for g, w in enumerate(self.windows) if w is not None]
        for index in reversed(range(k)):
            needing = [g for g, first in firsts if first <= index]
            if not needing:
                return None
            if not all(has(g, index) for g in needing):
                return index
        return None

    def layers_of(self, group: int) -> list[int]:
        """The group's layers, in the order of the tensors they use."""
        return [layer for layer, g in enumerate(self.layer_groups) if g == group]
