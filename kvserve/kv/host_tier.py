"""The host-memory tier's rows: one host tensor of block-sized rows, keyed by content (``kv/tiers.py`` is the
store that puts blocks there and takes them back)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Collection

import torch


class HostTier:
    """Block-sized rows of one host tensor, keyed by content, least recently used first out. Pinned keys (a
    load planned, a write under way) are never evicted; a reserved row belongs to its reserver until it is
    published or released. Not thread-safe: ``TieredStore`` locks around it."""

    def __init__(self, num_rows: int, bytes_per_block: int, pin_memory: bool) -> None:
        self.slab = torch.empty((num_rows, bytes_per_block), dtype=torch.uint8, pin_memory=pin_memory)
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # key -> row, least recently used first
        self._free = list(range(num_rows - 1, -1, -1))
        self._pins: Counter[bytes] = Counter()
        self.from_disk: set[bytes] = set()  # prefetched, not yet loaded: a hit on them is a disk hit
        # blocks of KV cache groups 1.. (``kv/groups.py``): a hit on one adds no hit tokens, as the group-0 block of
        # the same tokens counts them (or they were a hit on the device)
        self.other_groups: set[bytes] = set()

    @property
    def num_rows(self) -> int:
        return self.slab.shape[0]

    @property
    def num_blocks(self) -> int:
        return len(self._rows)

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def row(self, key: bytes) -> int:
        """The key's row, now the most recently used."""
        self._rows.move_to_end(key)
        return self._rows[key]

    def reserve(self, keep: Collection[bytes] = ()) -> int | None:
        """A row to fill: a free one, else the least recently used unpinned block's but those in ``keep`` (reads
        staged for waiting requests). None if all others are pinned."""
        if self._free:
            return self._free.pop()
        victim = next((key for key in self._rows if not self._pins[key] and key not in keep), None)
        if victim is None:
            return None
        self.from_disk.discard(victim)
        self.other_groups.discard(victim)
        return self._rows.pop(victim)

    def drop_unpinned(self, keep: Collection[bytes] = ()) -> int:
        """Free the rows of every unpinned block but those in ``keep``; returns how many were freed."""
        victims = [key for key in self._rows if not self._pins[key] and key not in keep]
        for key in victims:
            self._free.append(self._rows.pop(key))
            self.from_disk.discard(key)
            self.other_groups.discard(key)
        return len(victims)

    def num_unpinned_rows(self) -> int:
        """Rows free or holding a block that may be evicted: what reads can take."""
        return len(self._free) + sum(1 for key in self._rows if not self._pins[key])

    def hold(self, num_rows: int) -> list[int] | None:
        """``num_rows`` rows taken out of the tier for a caller to keep until it releases them (a swapped-out
        request's KV): free rows first, then the least recently used unpinned blocks'. All or nothing: None,
        taking none, if fewer rows than that are free or unpinned."""
        if len(self._free) < num_rows and self.num_unpinned_rows() < num_rows:
            return None
        rows = [self.reserve() for _ in range(num_rows)]
        assert None not in rows
        return rows

    def check_rows(self, held: list[int], num_reading: int) -> None:
        """Every row is free, indexed, held by a caller (``held``) or being read into; none is two of them."""
        free, indexed = set(self._free), set(self._rows.values())
        assert len(free) == len(self._free) and len(indexed) == len(self._rows), "a host row listed twice"
        assert len(set(held)) == len(held), f"a host row held twice: {sorted(held)}"
        assert not (free & set(held) or indexed & set(held)), "a held host row is also free or indexed"
        assert not free & indexed, "a host row is both free and indexed"
        assert self.other_groups <= self._rows.keys(), "a block of KV cache groups 1.. is marked but not held"
        num_accounted = len(free) + len(indexed) + len(held)
        assert num_accounted <= self.num_rows <= num_accounted + num_reading, (
            f"{len(free)} free + {len(indexed)} indexed + {len(held)} held host rows, {num_reading} being read: "
            f"{self.num_rows} rows in all"
        )

    def publish(self, key: bytes, row: int, group: int = 0) -> None:
        """A reserved row now holds ``key``'s block, of KV cache group ``group`` (a copy already held is
        replaced)."""
        if key in self._rows:
            self._free.append(self._rows.pop(key))
        self._rows[key] = row
        if group:
            self.other_groups.add(key)

    def release(self, row: int) -> None:
        self._free.append(row)

    def pin(self, key: bytes) -> None:
        self._pins[key] += 1

    def unpin(self, key: bytes) -> None:
        self._pins[key] -= 1
        if not self._pins[key]:
            del self._pins[key]
