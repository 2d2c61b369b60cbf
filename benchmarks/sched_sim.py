"""A workload's schedule without a model: the real ``Scheduler`` and KV manager at a run's settings, each step's
shape recorded (decode rows, their context, prefill tokens), and a cost model of the device's time on it. What a
GPU run should take, worked out on the CPU before a lease (benchmarks/GPU_NOTES.md).

    python benchmarks/sched_sim.py --max-num-seqs 512,384 [--num-requests 1000 --input-len 1000 --output-len 1000]

The defaults are issue 16's (c) on an H200 at Llama-3-8B's shape: a 54,004-block pool (what the engine sized
there), 16.06 GB of weights, 128 KiB of K/V a token, 15 GFLOP a token, 4.1 TB/s and 650 TFLOP/s. A step's time
is the larger of its weight read and its GEMM FLOPs, plus its K/V read and a fixed cost; host time is not
modelled (the overlapped scheduler hides it when it is shorter than the device's).
"""

from __future__ import annotations

import argparse
import sys

from sched_step import HostOnlyStep, prompt

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.sched.scheduler import Scheduler


def simulate(args: argparse.Namespace, max_num_seqs: int) -> dict[str, float]:
    max_model_len = args.input_len + args.output_len + args.block_size
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=args.budget,
                             max_model_len=max_model_len)
    scheduler = Scheduler(config, KVCacheManager(args.num_blocks, args.block_size, enable_prefix_caching=True))
    step = HostOnlyStep(scheduler, max_model_len)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        scheduler.add_request(Request(f"r{i}", prompt(f"r{i}", args.input_len), params))
    totals = dict(steps=0, steps_with_prefill=0, decode_rows=0, prefill_tokens=0, device_s=0.0)
    while scheduler.has_unfinished_requests():
        requests = step().requests
        tokens = sum(r.num_tokens for r in requests)
        decodes = [r for r in requests if r.is_decode]
        context = sum(r.start_pos + 1 for r in decodes)
        totals["steps"] += 1
        totals["steps_with_prefill"] += tokens > len(decodes)
        totals["decode_rows"] += len(decodes)
        totals["prefill_tokens"] += tokens - len(decodes)
        totals["device_s"] += (max(args.weight_bytes / args.bandwidth, tokens * args.flops_per_token / args.matrix_rate)
                               + context * args.kv_bytes_per_token / args.bandwidth + args.step_overhead)
    return {**totals, "preemptions": scheduler.num_preemptions,
            "output_tokens_per_s": args.num_requests * args.output_len / totals["device_s"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-num-seqs", default="512,384")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--num-blocks", type=int, default=54004)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--weight-bytes", type=float, default=16.06e9)
    parser.add_argument("--kv-bytes-per-token", type=float, default=131072)
    parser.add_argument("--flops-per-token", type=float, default=15e9)
    parser.add_argument("--bandwidth", type=float, default=4.1e12, help="bytes/s")
    parser.add_argument("--matrix-rate", type=float, default=650e12, help="FLOP/s")
    parser.add_argument("--step-overhead", type=float, default=0.4e-3, help="s a step: launches, sampling")
    args = parser.parse_args(argv)
    print("max_num_seqs  steps  with prefill  mean decode rows  prefill tokens  preemptions  modelled s  out tok/s")
    for max_num_seqs in (int(n) for n in args.max_num_seqs.split(",")):
        r = simulate(args, max_num_seqs)
        print(f"{max_num_seqs:12d}  {r['steps']:5d}  {r['steps_with_prefill']:12d}  "
              f"{r['decode_rows'] / r['steps']:16.0f}  {r['prefill_tokens']:14d}  {r['preemptions']:11d}  "
              f"{r['device_s']:10.1f}  {r['output_tokens_per_s']:9.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
