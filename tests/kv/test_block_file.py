"""Block files: a round trip is bit-exact, and every way a file can be wrong is refused with a reason."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from pathlib import Path

import pytest

from kvserve.kv import block_file
from kvserve.kv.block_file import BlockRecord, CorruptBlockError, read_block_file, write_block_file
from kvserve.kv.block_keys import block_key, group_key, root_key

PAYLOAD = bytes(range(256)) * 4


def _record(**changes) -> BlockRecord:
    parent = root_key("model-a", "int8", 4)
    fields = dict(key=block_key(parent, (5, 6, 7, 8)), parent_key=parent, token_ids=(5, 6, 7, 8),
                  model_identity="model-a", kv_dtype="int8", block_size=4, payload_bytes=len(PAYLOAD))
    return BlockRecord(**{**fields, **changes})


def _write(tmp_path: Path, record: BlockRecord | None = None) -> str:
    path = str(tmp_path / "block.kvb")
    write_block_file(path, record or _record(), memoryview(PAYLOAD))
    return path


def _read(path: str, expected: BlockRecord | None = None) -> bytes:
    out = bytearray(len(PAYLOAD))
    read_block_file(path, expected or _record(), memoryview(out))
    return bytes(out)


def test_round_trip_is_bit_exact_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = _write(tmp_path)
    assert _read(path) == PAYLOAD
    assert os.listdir(tmp_path) == ["block.kvb"]


@pytest.mark.parametrize(
    "expected, reason",
    [
        (_record(model_identity="model-b"), "model_identity"),
        (_record(kv_dtype="fp8"), "kv_dtype"),
        (_record(block_size=8), "block_size"),
        (_record(token_ids=(5, 6, 7, 9)), "token_ids"),
        (_record(parent_key=bytes(16)), "parent_key"),
        (_record(kv_layout="full:1;6:0"), "kv_layout"),  # a block of one KV cache group, not of every layer
    ],
)
def test_a_block_written_for_something_else_is_refused(tmp_path: Path, expected, reason) -> None:
    path = _write(tmp_path)
    with pytest.raises(CorruptBlockError, match=reason):
        _read(path, expected)


def test_a_kv_cache_groups_block_is_used_only_as_that_groups(tmp_path: Path) -> None:
    layout = "full:1;6:0"
    parent = root_key("model-a", "int8", 4, layout)
    window_block = _record(key=group_key(block_key(parent, (5, 6, 7, 8)), 1), parent_key=parent, kv_layout=layout,
                           group=1)
    path = _write(tmp_path, window_block)
    assert _read(path, window_block) == PAYLOAD
    with pytest.raises(CorruptBlockError, match="group is '1', expected '0'"):  # as the full group's block
        _read(path, dataclasses.replace(window_block, group=0))
    with pytest.raises(CorruptBlockError, match="key does not match"):  # a group's key forged for another
        _read(_write(tmp_path, dataclasses.replace(window_block, group=2)), dataclasses.replace(window_block, group=2))


def test_a_file_written_before_kv_cache_groups_is_a_plain_layout_block(tmp_path: Path) -> None:
    """Its header has neither ``kv_layout`` nor ``group``: it reads as a plain-layout block."""
    header = {k: v for k, v in _record().header(zlib.crc32(PAYLOAD)).items() if k not in ("kv_layout", "group")}
    raw = json.dumps(header).encode()
    path = tmp_path / "block.kvb"
    path.write_bytes(struct.pack("<6sHI", b"KVSBLK", 1, len(raw)) + raw + PAYLOAD)
    assert _read(str(path)) == PAYLOAD
    with pytest.raises(CorruptBlockError, match="kv_layout"):
        _read(str(path), _record(kv_layout="full:1;6:0"))


def test_a_key_that_does_not_hash_from_its_tokens_is_refused(tmp_path: Path) -> None:
    forged = _record(key=bytes(16))
    path = _write(tmp_path, forged)
    with pytest.raises(CorruptBlockError, match="key does not match"):
        _read(path, forged)


@pytest.mark.parametrize("cut", [3, 20, -1])
def test_a_truncated_file_is_refused(tmp_path: Path, cut: int) -> None:
    path = _write(tmp_path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:cut])
    with pytest.raises(CorruptBlockError, match="truncated"):
        _read(path)


def test_a_flipped_payload_bit_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path)
    data = bytearray(Path(path).read_bytes())
    data[-100] ^= 0x10
    Path(path).write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="checksum"):
        _read(path)


def test_a_file_of_something_else_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "block.kvb"
    path.write_bytes(b"GGUF" + bytes(2000))
    with pytest.raises(CorruptBlockError, match="not a version-1 kvserve block file"):
        _read(str(path))
    header = b"[1, 2]"
    path.write_bytes(struct.pack("<6sHI", b"KVSBLK", 1, len(header)) + header + PAYLOAD)
    with pytest.raises(CorruptBlockError, match="not an object"):
        _read(str(path))
    header = b"[" * 300_000 + b"]" * 300_000  # within the header bound, nested past json's recursion limit
    path.write_bytes(struct.pack("<6sHI", b"KVSBLK", 1, len(header)) + header + PAYLOAD)
    with pytest.raises(CorruptBlockError, match="unreadable header"):
        _read(str(path))


def test_header_fields_are_the_ones_documented(tmp_path: Path) -> None:
    data = Path(_write(tmp_path)).read_bytes()
    magic, version, header_len = struct.unpack_from("<6sHI", data)
    header = json.loads(data[12 : 12 + header_len])
    assert (magic, version) == (b"KVSBLK", 1)
    assert header["token_ids"] == [5, 6, 7, 8] and header["payload_bytes"] == len(PAYLOAD)


def test_a_failed_write_leaves_neither_a_block_nor_a_temporary_file(tmp_path: Path, monkeypatch) -> None:
    def full_disk(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(block_file.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        _write(tmp_path)
    assert os.listdir(tmp_path) == []
