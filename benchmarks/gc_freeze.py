"""What Python's full garbage collections cost a large batch, with the engine's heap frozen (``engine/gc_freeze.py``)
and without, taking turns in one process.

    python benchmarks/gc_freeze.py --batch 256 --rounds 3

A seeded tiny llama checkpoint keeps the model's share of a step small, so a step is mostly the engine's host
work (scheduling, input building, sampling, the scheduler's update, detokenizing), as it is on a GPU. Each
round runs ``--num-requests`` requests of ``--output-len`` tokens through ``LLM.generate``, ``--batch`` at a
time (continuous batching: finished outputs pile up as they would in a server's history), in each mode and reports the steps' median, P99 and longest time, the time the collector spent
(``gc.callbacks``) and the run's wall time. Without the freeze, the mode's steps run as ``generate`` would
run them had ``heap_frozen`` never been written.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kvserve.engine.llm as llm_module
from kvserve import LLM, SamplingParams
from kvserve.model.checkpoint import make_checkpoint


class CollectorClock:
    """Seconds spent in collections of each generation since ``reset``."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.counts[info["generation"]] += 1

    def reset(self) -> None:
        self.seconds, self.counts = [0.0, 0.0, 0.0], [0, 0, 0]


def run(llm: LLM, prompts: list[list[int]], output_len: int, clock: CollectorClock) -> dict:
    engine, step_times = llm.engine, []
    step = engine.step

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        outputs = step(*args, **kwargs)
        step_times.append(time.perf_counter() - start)
        return outputs

    engine.step = timed_step
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    clock.reset()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    del engine.step
    step_times.sort()
    return dict(wall_s=wall, steps=len(step_times), median_ms=1e3 * statistics.median(step_times),
                p99_ms=1e3 * step_times[int(0.99 * (len(step_times) - 1))], max_ms=1e3 * step_times[-1],
                gc_ms=[round(1e3 * s, 1) for s in clock.seconds], gc_counts=list(clock.counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = make_checkpoint(Path(tempfile.mkdtemp()) / "tiny-llama", "llama", "tiny")
    llm = LLM(str(model), max_num_seqs=args.batch, max_model_len=args.prompt_len + args.output_len + 8,
              max_num_batched_tokens=max(2048, args.batch))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (args.prompt_len,), generator=generator).tolist() for _ in range(args.num_requests)]
    clock = CollectorClock()
    gc.callbacks.append(clock)
    frozen = llm_module.heap_frozen
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"{len(gc.get_objects())} objects tracked after loading")
    run(llm, prompts[:8], 8, clock)  # warm-up
    for round_index in range(args.rounds):
        for mode in ("frozen", "not frozen"):
            llm_module.heap_frozen = frozen if mode == "frozen" else contextlib.nullcontext
            r = run(llm, prompts, args.output_len, clock)
            print(f"round {round_index + 1} {mode:>10}: wall {r['wall_s']:.2f} s, {r['steps']} steps, median "
                  f"{r['median_ms']:.2f} ms, P99 {r['p99_ms']:.2f}, max {r['max_ms']:.1f}; collections by "
                  f"generation {r['gc_counts']} took {r['gc_ms']} ms", flush=True)
    llm_module.heap_frozen = frozen


if __name__ == "__main__":
    main()
