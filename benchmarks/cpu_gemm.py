"""One decode step's GEMMs on CPU, fp32: ``F.linear``, oneDNN's blocked weights, kvserve's small-GEMM panels, and
the weights kept in GGUF blocks as the default model's file holds them (layers Q4_1, head Q8_0) read by
kvserve's block kernel, exact (fp32 activations) or with int8 activations.

    python benchmarks/cpu_gemm.py [--threads N] [--tokens 1,7,16,33,64,256]
    KVSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu_gemm.py   # AVX2 paths on an AVX-512 CPU

SmolLM2-135M's projections (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, 30 layers each, and
the 576->49152 LM head once), with 30 distinct weight copies per layer projection so that each comes from
memory, as in a real step. For each token count: the best of 3 passes over all of them, the kinds alternated.
``oneDNN``: ``CpuPrepackedLinearMethod`` without panels; ``panels``: the small-GEMM kernel alone (any row count);
``kvserve``: the linear method the engine selects for fp32 on CPU (panels up to the kernel's ``max_rows`` where tuned: every step on AVX2);
``Q4_1``: the layers in Q4_1 blocks through the exact block kernel, the LM head through the engine's fp32 method
(as before the head ran on blocks); ``blocks``: the layers in Q4_1 and the head in Q8_0 blocks (the engine's
tied head on the file's embeddings) through the exact kernel alone at every row count (where it crosses the
dense ``kvserve`` column sets its ``max_rows``); ``int8``: the same blocks as ``--quantize-activations``
multiplies them (``QDotGemm.batched``: its column tiles, then the int8 strips kernel); ``mapped``: the same
blocks as ``--load-format mmap`` multiplies them, with no dense copy (``GGMLGemm.batched``: the rows kernel,
then the strips kernel).
"""

from __future__ import annotations

import argparse
import os
import time

import gguf
import torch
import torch.nn.functional as F

from kvserve.model.layers.ggml import GGMLTensor, ggml_gemm
from kvserve.model.layers.ggml_qdot import qdot_gemm
from kvserve.model.layers.linear import linear_from_tensors
from kvserve.native import ISA_ENV_VAR
from kvserve.model.layers.prepacked import CpuPrepackedLinearMethod, SmallGemm
from kvserve.model.registry import select_linear_method

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
NUM_LAYERS, NUM_PASSES = 30, 3
Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1,7,16,33,64,256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(n, k) for name, (n, k) in SHAPES.items()
               for _ in range(1 if name == "lm_head" else NUM_LAYERS)]
    kernel = SmallGemm()
    isa = os.environ.get(ISA_ENV_VAR, "native")
    print(f"small-GEMM kernel built for {isa} ({ISA_ENV_VAR}): panels of {kernel.panel_width} columns, "
          f"{'used' if kernel.tuned else 'not used'} by the engine on this CPU")
    engine_method = select_linear_method(torch.device("cpu"), torch.float32)
    panels = [kernel.pack(w) for w in weights]
    kinds = {"F.linear": [lambda x, w=w: F.linear(x, w) for w in weights],
             "oneDNN": [linear_from_tensors(w, None, CpuPrepackedLinearMethod(None)) for w in weights],
             "panels": [lambda x, p=p, n=w.shape[0]: kernel(x, p, None, n) for w, p in zip(weights, panels)],
             "kvserve": [linear_from_tensors(w, None, engine_method) for w in weights]}
    kinds["Q4_1"] = [kinds["kvserve"][i] if w.shape[0] == SHAPES["lm_head"][0] else q4_1_linear(w)
                     for i, w in enumerate(weights)]
    blocks = [blocks_of(w, Q8_0 if w.shape[0] == SHAPES["lm_head"][0] else Q4_1) for w in weights]
    exact, int8 = ggml_gemm(), qdot_gemm()
    kinds["blocks"] = [lambda x, b=b: exact(x, b, None) for b in blocks]
    kinds["int8"] = [lambda x, b=b: int8.batched(x, b, None) for b in blocks]
    kinds["mapped"] = [lambda x, b=b: exact.batched(x, b, None) for b in blocks]
    print(f"{args.threads} threads; ms for one step's GEMMs (all layers and the LM head)")
    print(f"{'tokens':>6} " + " ".join(f"{kind:>9}" for kind in kinds) + "  kvserve vs F.linear, vs oneDNN")
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
            print(f"{num_tokens:6d} " + " ".join(f"{best[kind] * 1e3:9.1f}" for kind in kinds)
                  + f"  {best['F.linear'] / best['kvserve']:7.2f}x {best['oneDNN'] / best['kvserve']:7.2f}x")


def blocks_of(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> GGMLTensor:
    return GGMLTensor.from_numpy(gguf.quants.quantize(weight.numpy(), qtype), qtype)


def q4_1_linear(weight: torch.Tensor):
    """``weight`` quantized to Q4_1 by gguf, multiplied by the exact block kernel."""
    blocks, kernel = blocks_of(weight, Q4_1), ggml_gemm()
    return lambda x: kernel(x, blocks, None)


if __name__ == "__main__":
    main()
