"""Host time of a decode step without a model: the scheduler, the runner's input building and the scheduler's
update, per step, at 128 running requests (and a waiting queue that lpm re-orders every step), at two context
lengths. A step's host work should be flat in context length.

    python benchmarks/sched_step.py --contexts 512,8000
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import zlib

import torch

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.sched.output import ModelOutput, SchedulerOutput
from kvserve.sched.scheduler import Scheduler
from kvserve.worker.input_batch import build_input_batch

BLOCK_SIZE = 16
BUDGET = 16_384  # tokens a step: large, so that the prompts are computed in few steps


def prompt(request_id: str, num_tokens: int) -> list[int]:
    return [10 + zlib.crc32(f"{request_id}/{i}".encode()) % 40_000 for i in range(num_tokens)]


class HostOnlyStep:
    """Schedule, build the runner's inputs from scratch (the code before the persistent batch), make up one token
    per sampling request, update."""

    def __init__(self, scheduler: Scheduler, max_model_len: int) -> None:
        self.scheduler = scheduler

    def __call__(self) -> SchedulerOutput:
        sched_out = self.scheduler.schedule()
        if sched_out.requests:
            build_input_batch(sched_out, BLOCK_SIZE, torch.device("cpu"))
        sampled = {r.request_id: [11] for r in sched_out.requests if r.sample}
        self.scheduler.update_from_output(sched_out, ModelOutput(sampled))
        return sched_out


def measure(context_len: int, num_running: int, num_waiting: int, num_steps: int) -> float:
    """Median milliseconds of a decode step once every running request has computed its prompt."""
    num_prefill_steps = -(-num_running * context_len // BUDGET)  # the first requests decode meanwhile
    max_tokens = num_prefill_steps + num_steps + 8
    max_model_len = context_len + max_tokens
    num_blocks = (num_running + num_waiting) * (max_model_len // BLOCK_SIZE + 2)
    config = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=BUDGET, max_model_len=max_model_len)
    scheduler = Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True))
    step = HostOnlyStep(scheduler, max_model_len)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_running + num_waiting):
        scheduler.add_request(Request(f"r{i}", prompt(f"r{i}", context_len), params))
    while any(r.num_computed_tokens < context_len for r in scheduler.running) or len(scheduler.running) < num_running:
        step()
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        sched_out = step()
        times.append(time.perf_counter() - start)
        assert len(sched_out.requests) == num_running and scheduler.num_waiting == num_waiting
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="512,8000", help="comma-separated prompt lengths")
    parser.add_argument("--num-running", type=int, default=128)
    parser.add_argument("--num-waiting", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=30)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print("context  running  waiting  ms/step")
    for context_len in (int(c) for c in args.contexts.split(",")):
        ms = measure(context_len, args.num_running, args.num_waiting, args.num_steps)
        print(f"{context_len:7d}  {args.num_running:7d}  {args.num_waiting:7d}  {ms:7.3f}")


if __name__ == "__main__":
    main()
