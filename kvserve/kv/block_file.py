"""The on-disk format of one KV block, written atomically and trusted only once verified.

::

    | magic "KVSBLK" | version u16 | header length u32 | header: JSON | payload: the block's bytes |

The header names what the payload is for (model identity, KV dtype, block size, and the KV cache groups' layout
with the block's group), the block's own key, its parent's key and token ids, and the payload's length and CRC-32.
A reader accepts a file only if every one of these matches what it expects, the key recomputes from the parent
key, the tokens and the group, and the payload is whole with its checksum right; anything else raises
``CorruptBlockError`` naming what was wrong, so a block written for another model, dtype or layout, a truncated
file or flipped bits are never used. A file written before KV cache groups existed has neither the layout nor the
group: it reads as a block of the plain layout (every layer in a block).

A writer writes a temporary file beside the target and renames it into place (atomic on POSIX), so a reader
sees either no file or a whole one, never a torn block, even with two servers writing the same key.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import uuid
import zlib
from dataclasses import dataclass

from kvserve.kv.block_keys import block_key, group_key

TEMP_SUFFIX = ".tmp"  # a block file being written; renamed over the block's name once whole
MAGIC = b"KVSBLK"
VERSION = 1
_PREAMBLE = struct.Struct("<6sHI")  # magic, version, header length
_MAX_HEADER_BYTES = 1 << 20
_BEFORE_GROUPS = {"kv_layout": "", "group": 0}  # what a file written before KV cache groups holds


class CorruptBlockError(ValueError):
    """A block file that must not be used; the message says why."""


@dataclass(frozen=True)
class BlockRecord:
    """What a block file must hold: a block of ``token_ids`` after the prefix ending in ``parent_key``."""

    key: bytes
    parent_key: bytes
    token_ids: tuple[int, ...]
    model_identity: str
    kv_dtype: str
    block_size: int
    payload_bytes: int
    kv_layout: str = ""  # ``KVCacheGroups.layout``: '' for the plain layout
    group: int = 0  # the KV cache group whose block this is

    def header(self, payload_crc: int) -> dict:
        return {"model_identity": self.model_identity, "kv_dtype": self.kv_dtype, "block_size": self.block_size,
                "kv_layout": self.kv_layout, "group": self.group,
                "key": self.key.hex(), "parent_key": self.parent_key.hex(), "token_ids": list(self.token_ids),
                "payload_bytes": self.payload_bytes, "payload_crc32": payload_crc}


def write_block_file(path: str, record: BlockRecord, payload: memoryview) -> int:
    """Write ``payload`` as ``record``'s block at ``path`` atomically; returns the file's size. Raises OSError
    (a full disk, a read-only directory), leaving no temporary file behind."""
    if payload.nbytes != record.payload_bytes:
        raise ValueError(f"payload of {payload.nbytes} bytes for a block of {record.payload_bytes}")
    header = json.dumps(record.header(zlib.crc32(payload)), separators=(",", ":")).encode()
    tmp_path = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
    try:
        with open(tmp_path, "wb") as f:
            f.write(_PREAMBLE.pack(MAGIC, VERSION, len(header)))
            f.write(header)
            f.write(payload)
        os.replace(tmp_path, path)
    except BaseException:
        try:
            os.unlink(tmp_path)
        except OSError:
            pass
        raise
    return _PREAMBLE.size + len(header) + payload.nbytes


def read_block_file(path: str, expected: BlockRecord, out: memoryview) -> None:
    """Read the block at ``path`` into ``out`` (``expected.payload_bytes`` bytes) after checking it is exactly
    ``expected``'s. Raises CorruptBlockError saying what differs, or OSError if the file cannot be read.

    Opened without blocking and checked to be a regular file before a byte is read: a FIFO or a device at a
    block's path (a foreign entry in a shared directory) would otherwise hold the reading thread for good."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptBlockError("not a regular file")
    with os.fdopen(fd, "rb") as f:
        preamble = f.read(_PREAMBLE.size)
        if len(preamble) != _PREAMBLE.size:
            raise CorruptBlockError("truncated before its header")
        magic, version, header_len = _PREAMBLE.unpack(preamble)
        if magic != MAGIC or version != VERSION:
            raise CorruptBlockError(f"not a version-{VERSION} kvserve block file (magic {magic!r}, v{version})")
        if header_len > _MAX_HEADER_BYTES:
            raise CorruptBlockError(f"header length {header_len} is implausible")
        header = _parse_header(f.read(header_len), header_len)
        _check_header(header, expected)
        if f.readinto(out) != expected.payload_bytes or f.read(1):
            raise CorruptBlockError("payload is truncated or too long")
    if zlib.crc32(out) != header["payload_crc32"]:
        raise CorruptBlockError("payload checksum mismatch")


def _parse_header(raw: bytes, header_len: int) -> dict:
    if len(raw) != header_len:
        raise CorruptBlockError("truncated inside its header")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep (a crafted file)
        raise CorruptBlockError(f"unreadable header ({error})") from None
    if not isinstance(header, dict):
        raise CorruptBlockError("header is not an object")
    return header


def _check_header(header: dict, expected: BlockRecord) -> None:
    want = expected.header(payload_crc=0)
    header = {**_BEFORE_GROUPS, **header}
    for name in ("model_identity", "kv_dtype", "block_size", "kv_layout", "group", "key", "parent_key", "token_ids",
                 "payload_bytes"):
        if header.get(name) != want[name]:
            raise CorruptBlockError(f"{name} is {str(header.get(name))[:80]!r}, expected {str(want[name])[:80]!r}")
    if group_key(block_key(expected.parent_key, expected.token_ids), expected.group) != expected.key:
        raise CorruptBlockError("key does not match its parent key and tokens")
    if not isinstance(header.get("payload_crc32"), int):
        raise CorruptBlockError("header has no payload checksum")
