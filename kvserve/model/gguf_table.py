"""A GGUF file's tensor table (each tensor's name, ggml type, shape and offset), its architecture and its scalar
metadata values (numbers, flags and strings: the model's settings), read by stepping over the metadata arrays
rather than building them: gguf's reader makes a numpy view of every element of
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
# metadata value types: the fixed-size ones' layouts; 8 is a string, 9 an array
_SCALAR_LAYOUTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_SCALAR_BYTES = {kind: struct.calcsize(layout) for kind, layout in _SCALAR_LAYOUTS.items()}
_UINT32, _STRING, _ARRAY = 4, 8, 9
Scalar = int | float | bool | str


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
    scalars: dict[str, Scalar]  # every metadata value that is no array, by key
    array_keys: frozenset[str] = frozenset()  # the keys of the arrays (stepped over, not read)


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
        found: dict[str, Scalar] = {}
        seen_arrays: set[str] = set()
        for _ in range(num_values):
            key, kind = self.string(), self.unpack("<I")[0]
            if key in found or key in seen_arrays:
                raise ValueError(f"{self.path}: metadata key {key} given twice")
            if key in wanted and kind != wanted[key]:
                raise ValueError(f"{self.path}: {key} has value type {kind}, not {wanted[key]}")
            if kind == _ARRAY:
                seen_arrays.add(key)
                self.skip_value(kind)
            else:
                found[key] = self.scalar(kind)
        if "general.architecture" not in found:
            raise ValueError(f"{self.path}: no general.architecture in its metadata")
        entries = [self.tensor_entry() for _ in range(num_tensors)]
        if len({name for name, *_ in entries}) < len(entries):
            raise ValueError(f"{self.path}: a tensor name is given twice in its tensor table")
        alignment = int(found.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: general.alignment is {alignment}, not a power of two")
        start = -(-self.pos // alignment) * alignment
        tensors = tuple(GGUFTensor(name, qtype, shape, start + offset) for name, qtype, shape, offset in entries)
        return GGUFTable(str(found["general.architecture"]), tensors, found, frozenset(seen_arrays))

    def tensor_entry(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self.string()
        (num_dims,) = self.unpack("<I")
        dims = self.unpack(f"<{num_dims}Q")
        qtype, offset = self.unpack("<IQ")
        return name, qtype, tuple(reversed(dims)), offset  # ggml lists the fastest-moving dimension first

    def scalar(self, kind: int) -> Scalar:
        if kind == _STRING:
            return self.string()
        if kind not in _SCALAR_LAYOUTS:
            raise ValueError(f"{self.path}: unknown metadata value type {kind} at byte {self.pos}")
        return self.unpack(_SCALAR_LAYOUTS[kind])[0]

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
