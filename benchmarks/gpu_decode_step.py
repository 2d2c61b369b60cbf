"""Decode step time on a CUDA GPU at a published model's shape, with dummy weights, beside the HBM roofline
measured in the same run.

    python benchmarks/gpu_decode_step.py --shape llama3-8b --batch 1,64 [--enforce-eager] [--no-overlap-scheduling]
        [--quantization int4|int8] [--kv-cache-dtype int8|fp8|int4] [--json FILE]

For each batch size B: B requests of ``--prompt-len`` random tokens are prefilled, then every engine step
decodes all B (EOS ignored). The figure is the median wall time of ``--steps`` such steps (``LLMEngine.step``:
scheduling, the forward, sampling, the token ids' read back, detokenizing), the first few after the prefill
left out as warm-up, with the model runner's share of it (``ModelRunner.execute``). The roofline of a step is its weight bytes over the copy bandwidth measured here (a decode step reads
every weight once; K/V reads are counted apart, as they grow with the context).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams, triton_launch
from kvserve.bench.roofline import measure_copy_bandwidth
from kvserve.config import SchedulerConfig
from kvserve.engine.gc_freeze import heap_frozen
from kvserve.model import registry
from kvserve.model.checkpoint import SHAPES, make_config_only
from kvserve.model.layers.fused_ops import TorchFusedOps
from kvserve.model.layers.linear import Linear

NUM_WARMUP_STEPS = 4


def max_new_tokens(batch: int, prompt_len: int, num_steps: int, profile_steps: int) -> int:
    """What each request asks for: the measured steps, and room for the prefill's (the first requests decode while
    the last prefill, in what SchedulerConfig's default chunk leaves past a token for each decode)."""
    prefill_steps = -(-batch * prompt_len // (SchedulerConfig.max_num_batched_tokens - batch))
    return num_steps + profile_steps + NUM_WARMUP_STEPS + prefill_steps + 4


def max_model_len(args: argparse.Namespace, batch: int) -> int:
    """Room for every request's tokens; 256 past the measured steps where that is enough, as in sessions 14-36's
    runs (the block tables' width unchanged; 64 requests of 2,000 tokens prefill in 250 steps and need more)."""
    steps = max(args.steps + args.profile_steps + 256, max_new_tokens(batch, args.prompt_len, args.steps,
                                                                      args.profile_steps))
    return args.prompt_len + steps


def decode_step_seconds(llm: LLM, batch: int, prompt_len: int, num_steps: int,
                        profile_steps: int = 0) -> tuple[list[float], list[float]]:
    """The wall time of each all-decode step of ``batch`` requests, after the prefill and a warm-up, and of the
    model runner's part of each (inputs, forward, sampling, the token ids' read back: ``execute``, or with the
    engine's overlapped outputs ``launch`` and the call it returns). ``profile_steps`` more decode steps after
    those run under torch's profiler, whose device-kernel table is printed."""
    engine = llm.engine
    runner = engine.core.runner
    execute, launch, runner_times = runner.execute, runner.launch, []

    def timed_execute(sched_out):
        start = time.perf_counter()
        output = execute(sched_out)
        runner_times.append(time.perf_counter() - start)
        return output

    def timed_launch(sched_out):
        start = time.perf_counter()
        finish = launch(sched_out)
        launched = time.perf_counter() - start

        def timed_finish():
            start = time.perf_counter()
            output = finish()
            runner_times.append(launched + time.perf_counter() - start)
            return output

        return timed_finish

    runner.execute, runner.launch = timed_execute, timed_launch
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens(batch, prompt_len, num_steps, profile_steps),
                            ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(3, 500, (prompt_len,), generator=generator).tolist()  # no two share a prefix
        engine.add_request(f"decode-{batch}-{i}", {"prompt_token_ids": prompt}, params)
    times, runner_part = [], []
    profiler, first_profiled = None, NUM_WARMUP_STEPS + 1 + num_steps
    scheduler = engine.core.scheduler
    with heap_frozen():  # as the engine's own loops run (``LLM.generate``, the server's engine thread)
        while engine.has_unfinished_requests():
            # every request past its prompt and none about to finish: the step decodes all of them
            decoding = (scheduler.num_running == batch and not scheduler.num_waiting
                        and all(0 < r.num_output_tokens < r.max_tokens - 1 for r in scheduler.running))
            start = time.perf_counter()
            engine.step()
            if decoding:
                times.append(time.perf_counter() - start)
                runner_part.append(runner_times[-1])
                if profile_steps and len(times) == first_profiled:
                    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                  torch.profiler.ProfilerActivity.CUDA])
                    profiler.__enter__()
                elif profiler is not None and len(times) == first_profiled + profile_steps:
                    profiler.__exit__(None, None, None)
                    print_kernel_table(profiler, profile_steps, statistics.median(times[first_profiled:]))
                    profiler = None
    runner.execute, runner.launch = execute, launch
    kept = slice(NUM_WARMUP_STEPS + 1, NUM_WARMUP_STEPS + 1 + num_steps)
    return times[kept], runner_part[kept]


def print_kernel_table(profiler: torch.profiler.profile, num_steps: int, step_seconds: float) -> None:
    """The device kernels of the profiled steps by total time, per step, and their sum against the step."""
    kernels = [event for event in profiler.key_averages() if event.device_time_total > 0
               and event.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda event: -event.device_time_total)
    total_us = sum(event.device_time_total for event in kernels) / num_steps
    print(f"    device kernels per step: {total_us:.0f} us of a {step_seconds * 1e6:.0f} us step (profiled)")
    for event in kernels[:24]:
        print(f"    {event.device_time_total / num_steps:9.1f} us {event.count / num_steps:6.1f}x  {event.key[:110]}")


def kernel_choices(llm: LLM) -> dict[str, bool]:
    """Each linear method's measured choices as the steps left them: "<candidate> <key>" (the key: layer shape,
    ..., batch size class) -> whether the candidate (the skinny kernel, the dequantized GEMM) timed faster."""
    methods = {id(m.method): m.method for m in llm.engine.core.runner.model.modules() if isinstance(m, Linear)}
    return {f"{choices.name} {key}": took for method in methods.values() for choices in vars(method).values()
            if hasattr(choices, "made") for key, took in choices.made.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=tuple(SHAPES))
    parser.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="auto", help="int4 / int8: weight-only, quantized at load")
    parser.add_argument("--kv-cache-dtype", default="auto", help="int8 / fp8 / int4: KV quantized as written")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-overlap-scheduling", action="store_true",
                        help="schedule each step after the one before is read back (an A/B of the overlap)")
    parser.add_argument("--twin-ops", action="store_true",
                        help="the plain-PyTorch elementwise ops instead of the Triton ones (an A/B of the fusion)")
    parser.add_argument("--min-split-keys", type=int, default=None,
                        help="the Triton decode kernel's fewest keys a split reads (an A/B of flash-decoding's split)")
    parser.add_argument("--separate-merge", action="store_true",
                        help="flash-decoding's splits merged by a kernel of their own, not by the decode launch's "
                             "last program (an A/B of the fold)")
    parser.add_argument("--no-pdl", action="store_true",
                        help="Triton kernels launched without programmatic dependent launch (an A/B of it)")
    parser.add_argument("--torch-gemms", action="store_true",
                        help="every GEMM through torch, none through the skinny Triton kernel (an A/B of it)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="decode steps after the timed ones to run under torch's profiler (a kernel table)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    batches = [int(b) for b in args.batch.split(",")]
    if max(batches) >= SchedulerConfig.max_num_batched_tokens:  # the decodes would leave no room to prefill
        parser.error(f"--batch takes fewer than {SchedulerConfig.max_num_batched_tokens} sequences (the step's "
                     f"token budget), got {max(batches)}")
    if args.twin_ops:
        registry.select_fused_ops = lambda device, dtype: TorchFusedOps()
    if args.min_split_keys is not None or args.separate_merge:
        from kvserve.attention import triton_paged  # imports triton: CUDA only

        triton_paged.MIN_SPLIT_KEYS = args.min_split_keys or triton_paged.MIN_SPLIT_KEYS
        triton_paged.MERGE_IN_DECODE = not args.separate_merge
    if args.no_pdl:
        triton_launch.ENABLED = False
    if args.torch_gemms:
        from kvserve.model.layers import triton_skinny  # imports triton: CUDA only

        triton_skinny.SKINNY_ROWS = 0
    model = make_config_only(Path(tempfile.mkdtemp()) / args.shape, args.shape)
    device = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(device, 1 << 30)
    llm = LLM(str(model), load_format="dummy", device="cuda", dtype=args.dtype, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max(batches),
              max_model_len=max_model_len(args, max(batches)), enforce_eager=args.enforce_eager,
              overlap_scheduling=not args.no_overlap_scheduling)
    weight_bytes = llm.stats()["weights_bytes"]
    device_name = torch.cuda.get_device_name(device)
    print(f"{args.shape} {args.dtype} {llm.stats()['weights_format']}, KV {llm.stats()['kv_cache_dtype']} "
          f"{'eager' if args.enforce_eager else 'graphs'}"
          f"{', scheduled after each step' if args.no_overlap_scheduling else ''}"
          f"{', twin ops' if args.twin_ops else ''}"
          f"{f', splits of >= {args.min_split_keys} keys' if args.min_split_keys else ''}"
          f"{', separate merge' if args.separate_merge else ''}"
          f"{', torch GEMMs' if args.torch_gemms else ''}{', no PDL' if args.no_pdl else ''} on {device_name}: "
          f"copy {bandwidth / 1e9:.0f} GB/s, weights {weight_bytes / 1e9:.2f} GB")
    rows = []
    for batch in batches:
        times, runner_times = decode_step_seconds(llm, batch, args.prompt_len, args.steps, args.profile_steps)
        median, roofline = statistics.median(times), weight_bytes / bandwidth
        row = dict(batch=batch, median_ms=median * 1e3, min_ms=min(times) * 1e3, steps=len(times),
                   runner_median_ms=statistics.median(runner_times) * 1e3, tokens_per_s=batch / median,
                   roofline_ms=roofline * 1e3, fraction_of_roofline=roofline / median)
        rows.append(row)
        print(f"  batch {batch:4d}: step {row['median_ms']:8.3f} ms (min {row['min_ms']:.3f}; runner "
              f"{row['runner_median_ms']:.3f}), {row['tokens_per_s']:9.1f} tok/s, roofline "
              f"{row['roofline_ms']:.3f} ms = {100 * row['fraction_of_roofline']:.0f}%", flush=True)
    report = dict(shape=args.shape, dtype=args.dtype, weights_format=llm.stats()["weights_format"],
                  kv_cache_dtype=llm.stats()["kv_cache_dtype"],
                  enforce_eager=args.enforce_eager, twin_ops=args.twin_ops,
                  overlap_scheduling=not args.no_overlap_scheduling,
                  min_split_keys=args.min_split_keys, separate_merge=args.separate_merge,
                  torch_gemms=args.torch_gemms, pdl=not args.no_pdl, kernel_choices=kernel_choices(llm),
                  device=device_name,
                  copy_gb_per_s=bandwidth / 1e9, weight_bytes=weight_bytes, prompt_len=args.prompt_len, rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
