"""The GGUF tensor table read past the metadata: the same tensors, types, shapes and offsets as gguf's own
reader finds, for every kind of metadata value; a file that is not GGUF, or is cut short, is a ValueError naming
it."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvserve.model.gguf_table import read_tensor_table


def _write(path: Path, alignment: int | None) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("u8", 1), writer.add_int8("i8", -1), writer.add_uint16("u16", 2), writer.add_int16("i16", -2)
    writer.add_uint32("u32", 3), writer.add_int32("i32", -3), writer.add_float32("f32", 0.5)
    writer.add_uint64("u64", 4), writer.add_int64("i64", -4), writer.add_float64("f64", 0.25)
    writer.add_bool("flag", True), writer.add_string("text", "héllo")
    writer.add_array("numbers", [1, 2, 3]), writer.add_array("words", ["a", "", "ünï", "longer words"])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("output_norm.weight", np.ones(5, dtype=np.float16))
    blocks = np.arange(2 * 34, dtype=np.uint8).reshape(2, 34)  # two rows of one Q8_0 block: 32 values each
    writer.add_tensor("output.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_table_is_the_one_ggufs_reader_finds(tmp_path: Path, alignment: int | None) -> None:
    path = _write(tmp_path / "model.gguf", alignment)
    table = read_tensor_table(path)
    reader = gguf.GGUFReader(path)
    assert table.architecture == reader.fields["general.architecture"].contents() == "llama"
    assert [(t.name, t.qtype, t.offset) for t in table.tensors] == \
        [(t.name, int(t.tensor_type), t.data_offset) for t in reader.tensors]
    assert [t.shape for t in table.tensors] == [(3, 4), (5,), (2, 32)]  # values, in torch's order


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_value_error_naming_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "model.gguf", None)
    data, data_start = path.read_bytes(), read_tensor_table(path).tensors[0].offset
    other = tmp_path / "other.gguf"
    other.write_bytes(b"NOTAGGUF" + bytes(100))
    with pytest.raises(ValueError, match=f"{other} is not a GGUF file"):
        read_tensor_table(other)
    for cut in (30, 200, data_start - 40):  # in the header, the metadata, the tensor table
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"{short} is cut short"):
            read_tensor_table(short)


def _text(value: str) -> bytes:
    encoded = value.encode("utf-8", "surrogateescape")  # "\udcff": the byte 0xff, which is no UTF-8
    return struct.pack("<Q", len(encoded)) + encoded


ARCHITECTURE = ("general.architecture", 8, _text("llama"))


def _by_hand(path: Path, values: list[tuple[str, int, bytes]], tensor_names: tuple[str, ...] = ("a.weight",)) -> Path:
    """A GGUF of ``values`` (key, value type, payload) and F32 tensors of 4 values, written byte by byte: the
    malformed files gguf's writer would refuse to make."""
    data = b"GGUF" + struct.pack("<IQQ", 3, len(tensor_names), len(values))
    data += b"".join(_text(key) + struct.pack("<I", kind) + payload for key, kind, payload in values)
    data += b"".join(_text(name) + struct.pack("<I2QIQ", 2, 4, 1, 0, 16 * i) for i, name in enumerate(tensor_names))
    path.write_bytes(data + bytes(-len(data) % 64 + 16 * len(tensor_names)))
    return path


@pytest.mark.parametrize("values, names, problem", [
    ([ARCHITECTURE, ("general.alignment", 10, struct.pack("<Q", 64))], ("a.weight",),
     "general.alignment has value type 10, not 4"),
    ([ARCHITECTURE, ("general.alignment", 4, struct.pack("<I", 48))], ("a.weight",),
     "general.alignment is 48, not a power of two"),
    ([ARCHITECTURE, ("general.alignment", 4, struct.pack("<I", 0))], ("a.weight",),
     "general.alignment is 0, not a power of two"),
    ([ARCHITECTURE, ("x", 4, bytes(4)), ("x", 4, bytes(4))], ("a.weight",), "metadata key x given twice"),
    ([ARCHITECTURE], ("a.weight", "a.weight"), "a tensor name is given twice"),
    ([("general.name", 8, _text("no architecture"))], ("a.weight",), "no general.architecture"),
    ([ARCHITECTURE, ("odd", 13, b"")], ("a.weight",), "unknown metadata value type 13"),
    ([ARCHITECTURE, ("deep", 9, struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 0, 0))], ("a.weight",),
     "metadata arrays nested over 64 deep at byte"),  # was a RecursionError
    ([ARCHITECTURE, ("x", 4, bytes(4)), ("\udcff", 4, bytes(4))], ("a.weight",),
     "a metadata string at byte [0-9]+ is not UTF-8"),
])
def test_a_malformed_table_is_a_value_error_naming_the_problem(tmp_path: Path, values: list, names: tuple,
                                                              problem: str) -> None:
    path = _by_hand(tmp_path / "bad.gguf", values, names)
    with pytest.raises(ValueError, match=f"{path}: {problem}"):
        read_tensor_table(path)
    assert read_tensor_table(_by_hand(tmp_path / "good.gguf", [ARCHITECTURE])).tensors[0].shape == (1, 4)


def test_version_0_is_an_unknown_version_not_a_big_endian_file(tmp_path: Path) -> None:
    path = tmp_path / "zero.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 0, 0, 0))
    with pytest.raises(ValueError, match="GGUF version 0 .kvserve reads versions 2 and 3."):
        read_tensor_table(path)


def test_a_big_endian_file_is_refused_as_one(tmp_path: Path) -> None:
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("token_embd.weight", np.ones((2, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="a big-endian GGUF"):
        read_tensor_table(path)
