"""One decoder layer's elementwise ops on CPU, fp32: the plain-PyTorch twin, ``torch.compile`` of the twin, and
kvserve's C kernels (``CpuFusedOps``).

    python benchmarks/cpu_fused_ops.py [--threads N] [--tokens 1,4,16,512]
    KVSERVE_CPU_ISA=avx2 python benchmarks/cpu_fused_ops.py   # the AVX2 kernels on an AVX-512 CPU

At SmolLM2-135M's shapes (hidden 576, 9 + 3 heads of 64, intermediate 1536), a layer's four ops: the residual
add + RMSNorm twice, rotary on q and k in place inside the packed qkv rows, SiLU-and-multiply of the packed
gate_up rows. Each kind runs one layer at a time over 30 layers' distinct inputs, the kinds alternated, 10
rounds; µs per layer, the median and the fastest of those 300 (on a machine shared with other jobs the fastest
is the cost without preemption).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from kvserve.model.layers.activation import GatedMLP
from kvserve.model.layers.cpu_fused_ops import CpuFusedOps
from kvserve.model.layers.fused_ops import TorchFusedOps
from kvserve.model.layers.norm import RMSNorm

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536
NUM_LAYERS, NUM_ROUNDS = 30, 10


class CompiledTwin(TorchFusedOps):
    """The twin's ops through ``torch.compile`` (dynamic shapes: a step's token count varies)."""

    def __init__(self) -> None:
        self.rms_norm = torch.compile(super().rms_norm, dynamic=True)
        self.rotary_ = torch.compile(super().rotary_, dynamic=True)
        self.act_and_mul = torch.compile(super().act_and_mul, dynamic=True)


def layer_inputs(num_tokens: int) -> dict[str, torch.Tensor]:
    qkv_size = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    angles = torch.rand(num_tokens, 1, HEAD_DIM // 2) * 100
    return {"attn_out": torch.randn(num_tokens, HIDDEN), "mlp_out": torch.randn(num_tokens, HIDDEN),
            "residual": torch.randn(num_tokens, HIDDEN), "qkv": torch.randn(num_tokens, qkv_size),
            "cos": angles.cos(), "sin": angles.sin(), "gate_up": torch.randn(num_tokens, 2 * INTERMEDIATE)}


def run_layer(ops: TorchFusedOps, norm: RMSNorm, mlp: GatedMLP, t: dict[str, torch.Tensor]) -> None:
    ops.rms_norm(norm, t["mlp_out"], t["residual"])
    qk = t["qkv"][:, : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(-1, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM)
    ops.rotary_(qk, t["cos"], t["sin"])
    ops.rms_norm(norm, t["attn_out"], t["residual"])
    ops.act_and_mul(mlp, t["gate_up"])


def time_us(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="1,4,16,512")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    norm, mlp = RMSNorm(HIDDEN, 1e-5), GatedMLP(HIDDEN, INTERMEDIATE, "silu", bias=False)
    kinds = {"twin": TorchFusedOps(), "compiled": CompiledTwin(), "kernels": CpuFusedOps()}
    print(f"{args.threads} threads; µs per layer for its 4 elementwise ops, median (fastest)")
    print(f"{'tokens':>6} " + " ".join(f"{kind:>16}" for kind in kinds) + "  twin / kernels, compiled / kernels")
    with torch.inference_mode():
        for num_tokens in map(int, args.tokens.split(",")):
            layers = [layer_inputs(num_tokens) for _ in range(NUM_LAYERS)]
            for ops in kinds.values():  # warm up (and compile)
                run_layer(ops, norm, mlp, layers[0])
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            for _ in range(NUM_ROUNDS):
                for t in layers:
                    for kind, ops in kinds.items():
                        times[kind].append(time_us(lambda: run_layer(ops, norm, mlp, t)))
            median = {kind: statistics.median(ts) for kind, ts in times.items()}
            print(f"{num_tokens:>6} " + " ".join(f"{median[k]:>8.1f} ({min(times[k]):>5.0f})" for k in kinds)
                  + f"  {median['twin'] / median['kernels']:.2f}x, {median['compiled'] / median['kernels']:.2f}x")


if __name__ == "__main__":
    main()
