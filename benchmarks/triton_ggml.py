"""The Triton GGUF kernel (``triton_ggml.TritonGGMLGemm``) against torch's dense GEMM on CUDA, in the same run.

    python benchmarks/triton_ggml.py [--dtype bfloat16|float16|float32] [--iters N]

Weights: Llama-3-8B's projection shapes (n x k: 4096 x 4096, 14336 x 4096, 4096 x 14336) in every block type
the kernel reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K), random blocks with finite
fp16 scales (the times do not depend on the values); activations of 1, 8, 64 and 512 rows. The baseline is
``x @ W.T`` on the same weight dequantized to ``--dtype``. Each time is the median of ``--iters`` calls timed
with CUDA events after warm-up, with the GB/s of weight bytes each read (the blocks, or the dense weight) to
set against the HBM roofline (about 4.8 TB/s on an H200): a decode step (1-8 rows) is bound by those bytes.
Needs a GPU: on CPU it refuses (the interpreter's times say nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from kvserve.model.layers.ggml import GGMLTensor

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
ROWS = [1, 8, 64, 512]
# where each block's fp16 fields sit (random bytes there could be inf or NaN)
HALF_OFFSETS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
                Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(n: int, k: int, qtype: Q) -> GGMLTensor:
    """[n, k] random blocks of ``qtype`` on the GPU, their fp16 fields about 0.01."""
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (n, k // block_values, block_bytes), dtype=torch.uint8, device="cuda")
    for offset in HALF_OFFSETS[qtype]:
        scales = (torch.rand(n, k // block_values, 1, device="cuda") * 0.02).to(torch.float16)
        blocks[..., offset : offset + 2] = scales.view(torch.uint8)
    return GGMLTensor(blocks.reshape(n, -1), qtype, (n, k))


def time_ms(run: Callable[[], torch.Tensor], iters: int) -> float:
    """Median milliseconds of ``run`` after three warm-up calls (the first compiles)."""
    for _ in range(3):
        run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_arguments(description: str, script: str) -> argparse.Namespace:
    """The --dtype and --iters of a benchmark of Triton kernels; without a GPU, exit naming ``script``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{script} times CUDA kernels: run it on a machine with a GPU (on CPU they run only through "
                 "Triton's interpreter, whose times mean nothing)")
    return args


def main() -> None:
    args = cuda_arguments(__doc__.split("\n\n")[0], "triton_ggml.py")
    from kvserve.model.layers.triton_ggml import TRITON_TYPES, TritonGGMLGemm  # imports triton

    dtype, kernel = getattr(torch, args.dtype), TritonGGMLGemm()
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, median of {args.iters}")
    print(f"{'type':<6}{'n x k':>14}{'rows':>6}{'dense ms':>10}{'blocks ms':>11}{'speed-up':>10}"
          f"{'dense GB/s':>12}{'blocks GB/s':>13}")
    for qtype in sorted(TRITON_TYPES):
        for n, k in SHAPES:
            weight = random_blocks(n, k, qtype)
            dense = GGMLTensor(weight.blocks.cpu(), qtype, (n, k)).dequantize().to("cuda", dtype)
            for rows in ROWS:
                x = torch.randn(rows, k, dtype=dtype, device="cuda")
                dense_ms = time_ms(lambda: x @ dense.T, args.iters)
                blocks_ms = time_ms(lambda: kernel(x, weight, None), args.iters)
                print(f"{qtype.name:<6}{f'{n} x {k}':>14}{rows:>6}{dense_ms:>10.3f}{blocks_ms:>11.3f}"
                      f"{dense_ms / blocks_ms:>9.2f}x{dense.nbytes / dense_ms / 1e6:>12.0f}"
                      f"{weight.blocks.nbytes / blocks_ms / 1e6:>13.0f}")


if __name__ == "__main__":
    main()
