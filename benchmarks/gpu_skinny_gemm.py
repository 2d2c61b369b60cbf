"""The skinny GEMMs of a decode step on a CUDA GPU: torch's GEMM (cuBLAS) against the Triton kernels of
``kvserve/model/layers/triton_skinny.py`` over a grid of launch shapes, at a published model's projection
shapes and a few rows of activations, with the GB/s of weight each reads.

    python benchmarks/gpu_skinny_gemm.py [--shape llama3-8b] [--rows 1,2,4,8,16] [--json FILE]

Each timing replays a CUDA graph of one product per copy of the weight, over enough copies that they do not fit
in the L2 cache (as a step's layers, each with its own weights): the median of ``--iters`` replays over the
number of products. Every kernel's output is first checked against the fp32 product (relative error under
1e-2 for bf16).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.bench.roofline import measure_copy_bandwidth
from kvserve.model.checkpoint import SHAPES
from kvserve.model.layers.triton_skinny import SkinnyConfig, max_rows, skinny_linear

ROTATE_BYTES = 512 << 20  # weight copies per shape: at least this much, several times any L2


def projection_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of a decode step at a published shape."""
    config = SHAPES[shape][1]
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (config["vocab_size"], hidden)}


def candidate_configs() -> list[SkinnyConfig]:
    sums = [SkinnyConfig("sum", n, k, w, 1) for n, k, w in itertools.product((4, 8, 16), (256, 512, 1024), (4, 8))
            if n * k <= 8192]  # larger tiles spill the product's registers
    dots = [SkinnyConfig("dot", n, k, w, s) for n, k, w, s in
            itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 5))]
    return sums + dots


def time_products(product, weights: list[torch.Tensor], iters: int) -> float:
    """Seconds per product, from replays of a graph of one product per weight copy."""
    product(weights[0])  # compile / pick the algorithm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weight in weights:
            product(weight)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(weights))
    return statistics.median(times)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", choices=tuple(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    bandwidth = measure_copy_bandwidth(device, 1 << 30)
    print(f"{torch.cuda.get_device_name(device)}: copy {bandwidth / 1e9:.0f} GB/s; {args.shape} {args.dtype}")
    results = []
    for name, (n, k) in projection_shapes(args.shape).items():
        copies = max(2, -(-ROTATE_BYTES // (n * k * dtype.itemsize)))
        weights = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device=device, dtype=dtype)
            ref = x.double() @ weights[0].double().T
            best = {"torch": time_products(lambda w: F.linear(x, w), weights, args.iters)}
            errors = {"torch": relative_error(F.linear(x, weights[0]), ref.float())}
            for config in candidate_configs():
                if rows > max_rows(config):
                    continue
                label = f"{config.kernel} n{config.block_n} k{config.block_k} w{config.num_warps} s{config.num_stages}"
                try:
                    errors[label] = relative_error(skinny_linear(x, weights[0], None, config), ref.float())
                except Exception as error:  # a tile whose pipeline needs more shared memory than there is
                    print(f"  {name} rows {rows} {label}: {type(error).__name__}, skipped")
                    continue
                if errors[label] > 1e-2:
                    print(f"  {name} rows {rows} {label}: relative error {errors[label]:.2e}, skipped")
                    continue
                best[label] = time_products(lambda w: skinny_linear(x, w, None, config), weights, args.iters)
            ranked = sorted(best.items(), key=lambda item: item[1])
            gbps = {label: n * k * dtype.itemsize / seconds / 1e9 for label, seconds in ranked}
            top = ", ".join(f"{label} {gbps[label]:.0f}" for label, _ in ranked[:3])
            print(f"{name:8s} ({n}x{k}) rows {rows:3d}: torch {gbps['torch']:6.0f} GB/s "
                  f"({best['torch'] * 1e6:.1f} us); best {top}", flush=True)
            results.append(dict(layer=name, n=n, k=k, rows=rows, gb_per_s=gbps, errors=errors))
        del weights
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(shape=args.shape, dtype=args.dtype, copy_gb_per_s=bandwidth / 1e9,
                                                   device=torch.cuda.get_device_name(device), results=results),
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
