"""PrefixIndex: what the router remembers of the prompts it sent to one replica, to guess which replica holds
a new prompt's prefix in its KV cache.

The router sees text, not tokens (it is model-agnostic), so a prompt is cut into chunks of ``CHUNK_CHARS``
characters and each chunk is keyed by a hash chained over every chunk before it, as a replica keys its KV
blocks: a key stands for a whole prefix, and the longest run of leading keys a replica has seen is the longest
prefix it was sent. Keys age out least recently used first, as the replica's own cache evicts; the index is
an approximation of that cache, never a promise (SGLang's router keeps a character radix tree for the same
guess)::

    prompt:  | chunk 0 | chunk 1 | chunk 2 | tail < CHUNK_CHARS (not keyed)
    keys:      h0        h1 = H(h0, chunk 1)   h2 = H(h1, chunk 2)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

CHUNK_CHARS = 64


def prefix_keys(text: str) -> list[bytes]:
    """One chained key per full chunk of ``text``."""
    keys, previous = [], b""
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        previous = hashlib.blake2b(previous + text[start : start + CHUNK_CHARS].encode(), digest_size=8).digest()
        keys.append(previous)
    return keys


class PrefixIndex:
    """The prefix keys sent to one replica, least recently used first, at most ``max_keys`` of them."""

    def __init__(self, max_keys: int = 1 << 20) -> None:
        self.max_keys = max_keys
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` this replica was sent (a chained key implies every key before it)."""
        low, high = 0, len(keys)  # binary search: a key present means its whole prefix was sent
        while low < high:
            middle = (low + high + 1) // 2
            if keys[middle - 1] in self._keys:
                low = middle
            else:
                high = middle - 1
        return low

    def insert(self, keys: list[bytes]) -> None:
        """Remember ``keys`` as just sent, evicting the least recently used keys beyond ``max_keys``. The last
        key is touched first, so a prefix is always more recent than its extensions and eviction takes leaves
        first: a key's presence keeps implying its whole prefix."""
        for key in reversed(keys):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
