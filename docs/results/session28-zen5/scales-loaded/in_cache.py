import sys, time, numpy as np, torch
from gguf import GGMLQuantizationType as Q, quants
from kvserve.model.layers.ggml import GGMLGemm, GGMLTensor
from kvserve.native import load_library
from pathlib import Path
import os; torch.set_num_threads(int(os.environ.get("T", "1")))
n, k = 512, 1024
w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
libs = {"new": GGMLGemm()}
if len(sys.argv) > 1:
    libs["base"] = GGMLGemm(load_library(Path(sys.argv[1]) / "ggml_gemm.c"))
x = torch.randn(1, k)
for qt in (Q.Q4_1, Q.Q8_0):
    t = GGMLTensor.from_numpy(quants.quantize(w, qt), qt)
    res = {}
    for name, g in libs.items():
        best = 1e9
        for _ in range(5):
            s = time.perf_counter()
            for _ in range(200): g(x, t, None)
            best = min(best, (time.perf_counter() - s) / 200)
        res[name] = best / (n * k / 32) * 1e9
    print(qt.name, " ".join(f"{k}: {v:.2f} ns/group" for k, v in res.items()))
