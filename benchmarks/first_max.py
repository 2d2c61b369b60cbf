"""Each row's first argmax of fp32 logits: kvserve's C kernel (``kvserve/sample/csrc/first_max.c``) against its
twin, torch's ``max(dim)``, taking turns in one process; median microseconds a call and their ratio.

    python benchmarks/first_max.py [--shapes 1x262144,16x262144,1x49152,64x49152] [--calls 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kvserve.sample.argmax import first_max, reference_first_max


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1x262144,16x262144,1x49152,64x49152", help="rows x vocabulary, ...")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads; median us a call of "
          f"{args.rounds} alternating rounds")
    print(f"{'shape':>10} {'torch max(dim)':>15} {'kernel':>8} {'ratio':>6}")
    for shape in args.shapes.split(","):
        rows, vocab = map(int, shape.split("x"))
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(first_max(logits), reference_first_max(logits))
        times: dict[str, list[float]] = {"torch": [], "kernel": []}
        for _ in range(args.rounds):
            for name, fn in (("torch", reference_first_max), ("kernel", first_max)):
                fn(logits)
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn(logits)
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        ours, theirs = statistics.median(times["kernel"]), statistics.median(times["torch"])
        print(f"{shape:>10} {theirs:>15.1f} {ours:>8.1f} {theirs / ours:>5.1f}x")


if __name__ == "__main__":
    main()
