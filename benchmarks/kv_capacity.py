"""Blocks one KV budget holds per KV cache dtype, as ratios to the unquantized cache of the model's dtype
(issue 17's capacity target), at a published shape with dummy weights on the CPU.

    python benchmarks/kv_capacity.py [--shape smollm2-135m] [--gib 1.0]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kvserve import LLM
from kvserve.model.checkpoint import SHAPES, make_config_only

KV_DTYPES = ("auto", "int8", "fp8", "int4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=tuple(SHAPES))
    parser.add_argument("--gib", type=float, default=1.0, help="the KV budget")
    args = parser.parse_args()
    model = make_config_only(Path(tempfile.mkdtemp()) / args.shape, args.shape)
    for dtype in ("bfloat16", "float32"):
        blocks = {kv: LLM(str(model), load_format="dummy", device="cpu", dtype=dtype, kv_cache_memory=args.gib,
                          kv_cache_dtype=kv, max_num_seqs=256).stats()["num_blocks_total"] for kv in KV_DTYPES}
        ratios = ", ".join(f"{kv} {blocks[kv]} ({blocks[kv] / blocks['auto']:.2f}x)" for kv in KV_DTYPES)
        print(f"{args.shape}, {dtype} model, {args.gib} GiB of KV: blocks {ratios}")


if __name__ == "__main__":
    main()
