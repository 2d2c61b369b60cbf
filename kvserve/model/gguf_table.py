"""A GGUF file's tensor table (each tensor's name, ggml type, shape and offset) and its architecture, read by
stepping over the metadata values rather than building them: gguf's reader makes a numpy view of every element of
every array, 18 s for Gemma 3's 262k-token vocabulary on a slow 2-core CPU (Zen 3), where this takes 0.2 s.
transformers' fast reader (``transformers.integrations.gguf``) returns no offsets from its public function, and
its tensor table refuses ggml types it cannot dequantize (Gemma 3's file holds Q5_0)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits; no file in use still has it
DEFAULT_ALIGNMENT = 32  # the data section's, where general.alignment is not given
MAX_ARRAY_NESTING = 64  # arrays of arrays: gguf writes them (none deeper than two in any model)
# metadata value types: the fixed-size ones' widths; 8 is a string, 9 an array
_SCALAR_BYTES = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}
_UINT32, _STRING, _ARRAY = 4, 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: int  # the ggml type
    shape: tuple[int, ...]  # in torch's order: the slowest-moving dimension first
    offset: int  # of its first byte in the file


@dataclass(frozen=True)
class GGUFTable:
    architecture: str
    tensors: tuple[GGUFTensor, ...]


def read_tensor_table(path: Path) -> GGUFTable:
    """The tensor table of the GGUF file at ``path``; ValueError naming the problem where the file is not one."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _Cursor(data, path).table()


class _Cursor:
    """A position in the mapped file, advanced by each read."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.pos = data, path, 0

    def table(self) -> GGUFTable:
        if self.data[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (it starts with {bytes(self.data[:4])!r})")
        self.pos = 4
        version, num_tensors, num_values = self.unpack("<IQQ")
        if version not in VERSIONS:
            byte_swapped = version and version & 0xFFFF == 0  # a big-endian file's version read little-endian
            raise ValueError(f"{self.path}: " + ("a big-endian GGUF (kvserve reads little-endian files)" if byte_swapped
                                                 else f"GGUF version {version} (kvserve reads versions 2 and 3)"))
        wanted = {"general.architecture": _STRING, "general.alignment": _UINT32}
        found, seen = {}, set()
        for _ in range(num_values):
            key, kind = self.string(), self.unpack("<I")[0]
            if key in seen:
                raise ValueError(f"{self.path}: metadata key {key} given twice")
            seen.add(key)
            if key not in wanted:
                self.skip_value(kind)
            elif kind != wanted[key]:
                raise ValueError(f"{self.path}: {key} has value type {kind}, not {wanted[key]}")
            else:
                found[key] = self.string() if kind == _STRING else self.unpack("<I")[0]
        if "general.architecture" not in found:
            raise ValueError(f"{self.path}: no general.architecture in its metadata")
        entries = [self.tensor_entry() for _ in range(num_tensors)]
        if len({name for name, *_ in entries}) < len(entries):
            raise ValueError(f"{self.path}: a tensor name is given twice in its tensor table")
        alignment = found.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment is {alignment}, not a power of two")
        start = -(-self.pos // alignment) * alignment
        tensors = tuple(GGUFTensor(name, qtype, shape, start + offset) for name, qtype, shape, offset in entries)
        return GGUFTable(found["general.architecture"], tensors)

    def tensor_entry(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self.string()
        (num_dims,) = self.unpack("<I")
        dims = self.unpack(f"<{num_dims}Q")
        qtype, offset = self.unpack("<IQ")
        return name, qtype, tuple(reversed(dims)), offset  # ggml lists the fastest-moving dimension first

    def skip_value(self, kind: int, depth: int = 0) -> None:
        if kind == _STRING:
            self.advance(self.unpack("<Q")[0])
        elif kind == _ARRAY:
            if depth == MAX_ARRAY_NESTING:  # else a RecursionError, not naming the file
                raise ValueError(f"{self.path}: metadata arrays nested over {MAX_ARRAY_NESTING} deep at byte "
                                 f"{self.pos}")
            item_kind, count = self.unpack("<IQ")
            if item_kind in _SCALAR_BYTES:
                self.advance(count * _SCALAR_BYTES[item_kind])
            else:
                for _ in range(count):
                    self.skip_value(item_kind, depth + 1)
        elif kind in _SCALAR_BYTES:
            self.advance(_SCALAR_BYTES[kind])
        else:
            raise ValueError(f"{self.path}: unknown metadata value type {kind} at byte {self.pos}")

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        start = self.advance(length)
        try:
            return self.data[start:self.pos].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: a metadata string at byte {start} is not UTF-8") from None

    def unpack(self, layout: str) -> tuple:
        start = self.advance(struct.calcsize(layout))
        return struct.unpack_from(layout, self.data, start)

    def advance(self, num_bytes: int) -> int:
        """Move past ``num_bytes``; where they began."""
        start, self.pos = self.pos, self.pos + num_bytes
        if self.pos > len(self.data):
            raise ValueError(f"{self.path} is cut short: its metadata runs past its {len(self.data)} bytes")
        return start
