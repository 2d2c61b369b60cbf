"""The weight-only GEMM (``triton_weight_only``) on a CUDA GPU at Llama-3-8B's layer shapes, against cuBLAS on the
bf16 weight and, for INT4 at one row, torch's own INT4 kernel (``_weight_int4pack_mm``, gpt-fast's tinygemm)
where this torch has it: median time and the bytes of weight read per second, at 1, 4, 16 and 64 rows; at up to
4 rows a second line times the skinny kernel (``triton_skinny``) on the bf16 weight and on the codes.

    cd benchmarks && python triton_weight_only.py [--rows 1,4,16,64]

Each case rotates over enough copies of its weight to miss the L2 (60 MB on an H200), as a decode step's
layers do; the copy bandwidth measured in the same run is the ceiling.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton.testing

from kvserve.bench.roofline import measure_copy_bandwidth
from kvserve.model.layers.triton_skinny import SKINNY_ROWS, skinny_gemm
from kvserve.model.layers.triton_weight_only import weight_only_gemm
from kvserve.model.layers.weight_quant import PackedWeight, quantize_rows

# Llama-3-8B: the packed q/k/v and gate/up projections, o, down and the LM head, as [N, K]
LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}
L2_BYTES = 64 << 20


def median_ms(calls: list) -> float:
    """The median time of one call, each timing cycling through ``calls`` (one per weight copy)."""
    state = {"i": 0}

    def step() -> None:
        calls[state["i"] % len(calls)]()
        state["i"] += 1

    return triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median")


def tinygemm(weight: torch.Tensor) -> tuple | None:
    """torch's INT4 layout of ``weight`` in groups of 128 (gpt-fast's convention: value = (q - 8) * scale + zero),
    or None where this torch or GPU lacks the kernel."""
    try:
        quantized = quantize_rows(weight, "int4")  # the same codes and parameters as ours
        codes = quantized.codes.to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
        scale = quantized.scale.to(torch.bfloat16)
        zero = (quantized.offset.float() + 8 * quantized.scale.float()).to(torch.bfloat16)
        params = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, N, 2]
        x = torch.randn(1, weight.shape[1], device=weight.device, dtype=torch.bfloat16)
        torch.ops.aten._weight_int4pack_mm(x, packed, 128, params)
        return packed, params
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def skinny_line(name: str, x: torch.Tensor, weights: list[torch.Tensor], packed: dict[str, list[PackedWeight]],
                dense_ms: float, packed_ms: dict[str, float]) -> str:
    """The skinny kernel (``triton_skinny``) on the same weights and rows: bf16 against cuBLAS, the codes against
    the tensor-core weight-only kernel of the line above."""
    n, k = weights[0].shape
    ms = median_ms([lambda w=w: skinny_gemm(x, w, None) for w in weights])
    line = f"{'skinny':>8} {x.shape[0]:>4} | {ms:8.3f} {n * k * 2 / ms / 1e6:6.0f} {dense_ms / ms:5.2f}x cuBLAS |"
    for scheme, parts in packed.items():
        ms = median_ms([lambda p=p: skinny_gemm(x, p, None) for p in parts])
        line += f" {scheme} {ms:8.3f} {packed_ms[scheme] / ms:5.2f}x the {scheme} kernel |"
    return f"{line}  ({name})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,64")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    device = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(device, 1 << 30)
    print(f"{torch.cuda.get_device_name(device)}: copy {bandwidth / 1e9:.0f} GB/s")
    print(f"{'layer':>8} {'rows':>4} | {'bf16 ms':>8} {'GB/s':>6} | {'int8 ms':>8} {'GB/s':>6} {'x bf16':>6} | "
          f"{'int4 ms':>8} {'GB/s':>6} {'x bf16':>6} | {'tinygemm int4 ms':>16}")
    for name, (n, k) in LAYERS.items():
        copies = max(2, -(-2 * L2_BYTES // (n * k * 2)))
        weights = [torch.empty(n, k, device=device, dtype=torch.bfloat16).uniform_(-0.05, 0.05)
                   for _ in range(copies)]
        packed = {scheme: [PackedWeight.of(quantize_rows(w, scheme)) for w in weights] for scheme in ("int8", "int4")}
        first = tinygemm(weights[0])
        tiny = [first, *(tinygemm(w) for w in weights[1:])] if first else None
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            dense_ms = median_ms([lambda w=w: F.linear(x, w) for w in weights])
            line, line_ms = f"{name:>8} {rows:>4} | {dense_ms:8.3f} {n * k * 2 / dense_ms / 1e6:6.0f} |", {}
            for scheme in ("int8", "int4"):
                parts = packed[scheme]
                nbytes = sum(t.numel() * t.element_size() for t in (parts[0].codes, parts[0].scale, parts[0].offset)
                             if t is not None)
                ms = median_ms([lambda p=p: weight_only_gemm(x, p, None) for p in parts])
                line_ms[scheme] = ms
                line += f" {ms:8.3f} {nbytes / ms / 1e6:6.0f} {dense_ms / ms:6.2f} |"
            if tiny is not None and rows == 1:
                ms = median_ms([lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], 128, t[1]) for t in tiny])
                line += f" {ms:16.3f}"
            print(line, flush=True)
            if rows <= SKINNY_ROWS:
                print(skinny_line(name, x, weights, packed, dense_ms, line_ms), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
