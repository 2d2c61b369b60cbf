"""PrefixIndex: what the router remembers of the prompts it sent to one replica, to guess which replica holds
a new prompt's prefix in its KV cache.

The router sees text, not tokens (it is model-agnostic), so a prompt is cut into chunks of ``CHUNK_CHARS``
characters and each chunk is keyed by a hash chained over every chunk before it, as a replica keys its KV
blocks: a key stands for a whole prefix, and the longest run of leading keys a replica has seen is the longest
prefix it was sent. Keys age out least recently used first, as the replica's own cache evicts; the index is
an approximation of that cache, never a promise (SGLang's router keeps a character radix tree for the same
guess)::

    prompt:  | chunk 0 | chunk 1 | chunk 2 | ... | chunk MAX_KEYED_CHUNKS - 1 | the rest (not keyed)
    keys:      h0        h1 = H(h0, chunk 1)   ...   (a tail under CHUNK_CHARS is not keyed either)

Only the first ``MAX_KEYED_CHUNKS`` chunks are keyed, so that a prompt costs the router O(that) whatever its size
(a 4 MiB one took 106 ms of its event loop and 62,500 keys of the replica's index). Routing needs only the
replica with the longest match, and two prompts sharing that many chunks (128 Ki characters, about 32 k tokens
of English text, more than a replica's usual context holds) are both routed by that shared prefix anyway.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from typing import NamedTuple

CHUNK_CHARS = 64
MAX_KEYED_CHUNKS = 2048
MAX_KEYED_CHARS = CHUNK_CHARS * MAX_KEYED_CHUNKS


def prefix_keys(text: str) -> list[bytes]:
    """One chained key per full chunk of ``text``, for its first ``MAX_KEYED_CHUNKS`` chunks. Any text is keyed:
    a lone surrogate (which a replica refuses with a 400) is hashed as it stands, not raised on."""
    keys, previous = [], b""
    for start in range(0, min(len(text), MAX_KEYED_CHARS) - CHUNK_CHARS + 1, CHUNK_CHARS):
        chunk = text[start : start + CHUNK_CHARS].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + chunk, digest_size=8).digest()
        keys.append(previous)
    return keys


class Insertion(NamedTuple):
    new_keys: list[bytes]  # the keys an insert added (the ones before them were present already)
    stamp: int  # which insert it was: a key keeps the stamp of the last insert that touched it


class PrefixIndex:
    """The prefix keys sent to one replica, least recently used first, at most ``max_keys`` of them."""

    def __init__(self, max_keys: int = 1 << 20) -> None:
        self.max_keys = max_keys
        self._keys: OrderedDict[bytes, int] = OrderedDict()
        self._stamps = itertools.count()

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

    def insert(self, keys: list[bytes]) -> Insertion:
        """Remember ``keys`` as just sent, evicting the least recently used keys beyond ``max_keys``; what to
        ``forget`` if the replica refuses the request. The last key is touched first, so a prefix is always more
        recent than its extensions and eviction takes leaves first: a key's presence keeps implying its whole
        prefix."""
        insertion = Insertion(keys[self.match(keys) :], next(self._stamps))
        for key in reversed(keys):
            self._keys[key] = insertion.stamp
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return insertion

    def forget(self, insertion: Insertion) -> None:
        """Undo an ``insert`` for a request the replica refused (it cached nothing): drop the keys it added
        that no insert has touched since. Those are a tail of its keys (an insert that touches a key touches
        its whole prefix too), and no key of another prompt extends them (that prompt's insert would have
        touched them), so a present key still implies its whole prefix."""
        for key in insertion.new_keys:
            if self._keys.get(key) == insertion.stamp:
                del self._keys[key]
