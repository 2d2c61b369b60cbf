"""The GGUF block kernels on a pulled model's own weights, one decode step's worth: every 2-D tensor of the file
multiplied once by a random x of ``--rows`` rows, through the exact kernel (``csrc/ggml_gemm.c``) and the
int8-activation one (``csrc/ggml_qdot.c``), in alternating passes; per block type, the median pass's ms and the GB/s
of blocks it read.

    python benchmarks/gguf_kernels.py [--model gemma-3-270m] [--rows 1] [--passes 7] [--threads 2]
    python benchmarks/gguf_kernels.py --baseline DIR   # also the kernels built from DIR (ggml_gemm.c, ggml_qdot.c
                                                       # and ggml_blocks.h of another revision, e.g. from
                                                       # `git show REV:kvserve/model/layers/csrc/ggml_gemm.c`)
    python benchmarks/gguf_kernels.py --rows 16 --batched   # each kernel's product with no dense copy
                                                            # (`--load-format mmap`: the strips kernels)

The weights come from memory, as in a step (a pass reads the whole file: Gemma 3 270M's 246 MB, SmolLM2's 98 MB).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from gguf import GGMLQuantizationType

from kvserve.model.gguf_index import load_gguf_index
from kvserve.model.layers.ggml import GGML_GEMM_SOURCE, GGMLGemm, GGMLTensor
from kvserve.model.layers.ggml_qdot import GGML_QDOT_SOURCE, QDotGemm
from kvserve.model.packaged import pull
from kvserve.native import load_library


def kernels(baseline: Path | None, batched: bool) -> dict[str, Callable[..., torch.Tensor]]:
    """Each kind's product ``(x, weight, bias)``: the exact kernel and the int8-activation one (``batched``: as
    with no dense copy); with ``baseline``, each again as built from that folder."""
    kernels: dict[str, GGMLGemm | QDotGemm] = {"exact": GGMLGemm(), "int8": QDotGemm()}
    if baseline is not None:
        kernels["exact (baseline)"] = GGMLGemm(load_library(baseline / GGML_GEMM_SOURCE.name))
        try:
            kernels["int8 (baseline)"] = QDotGemm(load_library(baseline / GGML_QDOT_SOURCE.name))
        except AttributeError:  # a revision before the int8 strips kernel
            pass
    if batched:
        return {f"{kind}, batched": kernel.batched for kind, kernel in kernels.items()}
    return dict(kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="a folder with another revision's kernel sources")
    parser.add_argument("--batched", action="store_true", help="the exact kernel as `--load-format mmap` runs it")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = pull(args.model, progress=False)
    index = load_gguf_index(path)
    weights = [GGMLTensor.from_numpy(array, GGMLQuantizationType(entry.qtype))
               for entry, array in index.arrays(path) if len(entry.dims) == 2 and entry.qtype not in (0, 1)]
    xs = {w.shape[1]: torch.randn(args.rows, w.shape[1]) for w in weights}
    kinds = kernels(args.baseline, args.batched)
    times: dict[str, dict[str, list[float]]] = {kind: collections.defaultdict(list) for kind in kinds}
    for _ in range(args.passes):
        for kind, kernel in kinds.items():
            per_type: dict[str, float] = collections.defaultdict(float)
            for w in weights:
                start = time.perf_counter()
                kernel(xs[w.shape[1]], w, None)
                per_type[w.qtype.name] += time.perf_counter() - start
            for qtype, seconds in per_type.items():
                times[kind][qtype].append(seconds)
    num_bytes: dict[str, int] = collections.defaultdict(int)
    for w in weights:
        num_bytes[w.qtype.name] += w.blocks.numel()
    print(f"{args.model}, {args.rows} row(s), {args.threads} threads, median of {args.passes} alternating passes")
    print(f"{'type':6s} {'MB':>6s}  " + "  ".join(f"{kind:>26s}" for kind in kinds))
    for qtype in sorted(num_bytes):
        cells = []
        for kind in kinds:
            seconds = statistics.median(times[kind][qtype])
            cells.append(f"{seconds * 1e3:7.2f} ms {num_bytes[qtype] / seconds / 1e9:5.1f} GB/s")
        print(f"{qtype:6s} {num_bytes[qtype] / 1e6:6.1f}  " + "  ".join(f"{cell:>26s}" for cell in cells))
    totals = {kind: sum(statistics.median(v) for v in times[kind].values()) for kind in kinds}
    print(f"{'all':6s} {sum(num_bytes.values()) / 1e6:6.1f}  " + "  ".join(f"{totals[k] * 1e3:>23.2f} ms" for k in kinds))


if __name__ == "__main__":
    main()
