"""Content keys of KV blocks, stable across processes, restarts and machines.

A block's key names everything its KV depends on: the model and how its KV is stored (the root), and every
token of the prefix up to the block's end, chained through its parent's key::

    root   = H("kvserve-kv-block/1" | model identity | KV dtype | block size [| KV layout])
    root of requests with a cache_salt = H(root | "salt" | the salt as UTF-8)
    root of requests with a LoRA adapter = H(root | "lora" | the adapter's digest) [then salted as above]
    key(b) = H(key(parent of b) | b's token ids as little-endian int32)
    key of KV cache group g's block of b's tokens (g >= 1) = H(key(b) | "group" | g)

With KV cache groups (``kv/groups.py``) a block id holds one group's layers, not every layer: the layout (which
layers each group's blocks hold) joins the root, so a block of one layout is never found under another's keys,
and each group's block of the same tokens has a key of its own, chained from group 0's (the prefix tree's).
Requests with a ``cache_salt`` (vLLM's field) chain from a root of their salt's: their blocks, in the tiers as in
the prefix tree, are shared only with requests that send the same salt. Requests with a LoRA adapter chain from
a root of the adapter's content (its files' digest, not its name: a restarted server with another adapter behind
the same name never reads the old one's blocks from the disk tier); the two make a ``CacheNamespace``.

H is BLAKE2b with a 16-byte digest, never Python's ``hash`` (salted per process), so a block written by one
server is found under the same key by a restarted one or by a second server on the same directory, and
blocks of another model, KV dtype or block size live under other keys altogether. The model identity is
``model/identity.py``'s fingerprint of the loaded model.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple, Sequence

KEY_BYTES = 16
_NAMESPACE = b"kvserve-kv-block/1"


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


def root_key(model_identity: str, kv_dtype: str, block_size: int, kv_layout: str = "") -> bytes:
    """The key a model's first block chains from. ``kv_layout`` (``KVCacheGroups.layout``) is '' for the plain
    layout, every layer in each block, whose keys stay what they were before groups existed."""
    parts = [_NAMESPACE, model_identity.encode(), kv_dtype.encode(), str(block_size).encode()]
    return _digest(b"|".join(parts + [kv_layout.encode()] * bool(kv_layout)))


def salted_root_key(root: bytes, salt: str) -> bytes:
    """The root of the blocks of requests sent with ``cache_salt=salt``, chained from the engine's ``root``."""
    return _digest(root + b"|salt|" + salt.encode())


class CacheNamespace(NamedTuple):
    """Which requests share cached KV blocks: those of the same ``cache_salt`` and the same LoRA adapter
    (``adapter``: its content digest; None: the base model)."""

    salt: str | None = None
    adapter: str | None = None


def namespace_root_key(root: bytes, namespace: CacheNamespace) -> bytes:
    """The root of the blocks of requests in ``namespace``, chained from the engine's ``root`` (a salt alone keeps
    ``salted_root_key``'s root, so the disk tier's salted blocks keep their keys)."""
    if namespace.adapter is not None:
        root = _digest(root + b"|lora|" + namespace.adapter.encode())
    return root if namespace.salt is None else salted_root_key(root, namespace.salt)


def block_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of the block holding ``token_ids`` after the prefix whose last block has ``parent_key``."""
    return _digest(parent_key + struct.pack(f"<{len(token_ids)}i", *token_ids))


def group_key(key: bytes, group: int) -> bytes:
    """The key of KV cache group ``group``'s block of the tokens whose group-0 block has ``key``."""
    return key if group == 0 else _digest(key + b"|group|" + str(group).encode())


class KeyedBlock(NamedTuple):
    """A full block named by its content: its key, its parent's key (group 0's), its token ids and its KV cache
    group (``key == group_key(block_key(parent_key, token_ids), group)``)."""

    key: bytes
    parent_key: bytes
    token_ids: tuple[int, ...]
    group: int = 0
