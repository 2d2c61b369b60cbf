"""The exact GGUF block kernel on a weight that stays in cache: ns a group of 32 values, this tree's build against
the build of the kernel sources in DIR, one after the other in one process (best of 5 rounds of 200 calls).

    python in_cache.py DIR            # T=2 for two threads; KVSERVE_CPU_ISA=avx2 for the AVX2 builds
"""

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from kvserve.model.layers.ggml import GGMLGemm, GGMLTensor
from kvserve.native import load_library

N, K = 512, 1024


def ns_per_group(kernel: GGMLGemm, x: torch.Tensor, weight: GGMLTensor) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            kernel(x, weight, None)
        best = min(best, (time.perf_counter() - start) / 200)
    return best / (N * K / 32) * 1e9


def main() -> None:
    torch.set_num_threads(int(os.environ.get("T", "1")))
    kernels = {"new": GGMLGemm(), "base": GGMLGemm(load_library(Path(sys.argv[1]) / "ggml_gemm.c"))}
    values = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    x = torch.randn(1, K)
    for qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        weight = GGMLTensor.from_numpy(quants.quantize(values, qtype), qtype)
        cells = [f"{name}: {ns_per_group(kernel, x, weight):.2f} ns/group" for name, kernel in kernels.items()]
        print(qtype.name, " ".join(cells))


if __name__ == "__main__":
    main()
