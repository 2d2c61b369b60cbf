"""One decode step's GEMMs on CPU, fp32: ``F.linear`` against kvserve's ``PrepackedLinear`` (oneDNN layout).

    python benchmarks/cpu_gemm.py [--threads N] [--tokens 1,7,16,33,64,256]

SmolLM2-135M's projections (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, 30 layers each, and
the 576->49152 LM head once), with 30 distinct weight copies per layer projection so that each comes from
memory, as in a real step. For each token count: the best of 3 passes over all of them, both kinds alternated.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvserve.model.layers.prepacked import PrepackedLinear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
NUM_LAYERS, NUM_PASSES = 30, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1,7,16,33,64,256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(n, k) for name, (n, k) in SHAPES.items()
               for _ in range(1 if name == "lm_head" else NUM_LAYERS)]
    packed = [PrepackedLinear(w, None) for w in weights]
    kinds = {"F.linear": [lambda x, w=w: F.linear(x, w) for w in weights], "prepacked": packed}
    print(f"{args.threads} threads; ms for one step's GEMMs (all layers and the LM head)")
    print(f"{'tokens':>6} {'F.linear':>9} {'prepacked':>9} {'speedup':>8}")
    with torch.no_grad():
        for num_tokens in map(int, args.tokens.split(",")):
            inputs = {k: torch.randn(num_tokens, k) for k in {k for _, k in SHAPES.values()}}
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(NUM_PASSES + 1):  # the first pass warms up
                for kind, fns in kinds.items():
                    start = time.perf_counter()
                    for w, fn in zip(weights, fns):
                        fn(inputs[w.shape[1]])
                    best[kind] = min(best[kind], time.perf_counter() - start)
            print(f"{num_tokens:6d} {best['F.linear'] * 1e3:9.1f} {best['prepacked'] * 1e3:9.1f} "
                  f"{best['F.linear'] / best['prepacked']:7.2f}x")


if __name__ == "__main__":
    main()
