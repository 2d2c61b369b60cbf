"""The sampler's cost, this tree against a baseline checkout taking turns (each run its own process):

    python benchmarks/sampling.py seeded [--baseline TREE] [--cases 1x49152,16x49152,...]
    python benchmarks/sampling.py penalties [--baseline TREE] [--cases 16x49152,...]
    python benchmarks/sampling.py generate [--baseline TREE] [--streams 16,1] [--top-p 0.9]

``seeded``: one step's sampling (``Sampler``) with every row seeded (temperature 0.8), ROWSxVOCAB random logits,
the median ms of 20 calls. ``penalties``: 64 greedy steps of rows with repetition, presence and frequency
penalties and 1,000-token prompts, the median ms of a step after the first. ``generate``: SmolLM2 as shipped
(from the model cache) decoding with temperature 1.0 (and ``--top-p``), 64-token synthetic prompts, 128 tokens
out, ``LLM.generate``'s output tok/s. ``--baseline`` is another checkout of kvserve (``git worktree add``); each
of ``--rounds`` rounds runs this tree, then the baseline, on 2 threads; the median of the rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def seeded(rows: int, vocab: int) -> float:
    from kvserve.sample.metadata import SamplingBatch, SamplingRow
    from kvserve.sample.sampler import Sampler
    from kvserve.sampling_params import SamplingParams

    batch = SamplingBatch([SamplingRow(SamplingParams(temperature=0.8, seed=s), 0, f"r{s}", [1, 2, 3], [4] * s)
                           for s in range(rows)])
    logits, sampler, times = torch.randn(rows, vocab), Sampler(), []
    for _ in range(22):
        x = logits.clone()
        start = time.perf_counter()
        sampler(x, batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def penalties(rows: int, vocab: int) -> float:
    from kvserve.sample.metadata import SamplingBatch, SamplingRow
    from kvserve.sample.sampler import Sampler
    from kvserve.sampling_params import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(temperature=0, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3)
    sampling_rows = [SamplingRow(params, 0, f"r{i}", [rng.randrange(vocab) for _ in range(1000)], [])
                     for i in range(rows)]
    batch, sampler, times = SamplingBatch(sampling_rows), Sampler(), []
    for _ in range(64):
        logits = torch.randn(rows, vocab)
        start = time.perf_counter()
        out = sampler(logits, batch)
        times.append(time.perf_counter() - start)
        for row, tokens in zip(sampling_rows, out.token_ids):
            row.output_token_ids.extend(tokens)  # type: ignore[attr-defined]
    return statistics.median(times[1:]) * 1e3


def generate(streams: int, top_p: float) -> float:
    from kvserve import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", seed=0)
    prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 5000 for j in range(64)]} for i in range(streams)]
    llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


SCENARIOS = {"seeded": (seeded, "ms a step"), "penalties": (penalties, "ms a step"),
             "generate": (generate, "output tok/s")}


def measure_in(tree: Path, scenario: str, args: list) -> float:
    """One measurement with kvserve imported from ``tree``, in a fresh process."""
    command = [sys.executable, __file__, "measure", scenario, json.dumps(args)]
    out = subprocess.run(command, check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tree)})
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["measure"]:  # the child: python sampling.py measure SCENARIO ARGS-JSON
        torch.set_num_threads(2)
        print(SCENARIOS[sys.argv[2]][0](*json.loads(sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=list(SCENARIOS))
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout of kvserve to take turns with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="1x49152,16x49152,64x49152,1x262144,16x262144",
                        help="ROWSxVOCAB cases (seeded, penalties)")
    parser.add_argument("--streams", default="16,1", help="streams (generate)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top_p (generate)")
    args = parser.parse_args()
    trees = {"this tree": Path(__file__).resolve().parents[1]}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    if args.scenario == "generate":
        cases = [[int(s), args.top_p] for s in args.streams.split(",")]
    else:
        cases = [[int(n) for n in case.split("x")] for case in args.cases.split(",")]
    unit = SCENARIOS[args.scenario][1]
    for case in cases:
        results: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                results[name].append(measure_in(tree, args.scenario, case))
        medians = {name: statistics.median(values) for name, values in results.items()}
        line = f"{args.scenario} {case}: " + ", ".join(
            f"{name} {medians[name]:.2f} {unit} {[round(v, 2) for v in results[name]]}" for name in trees)
        if "baseline" in medians:
            faster = medians["this tree"] / medians["baseline"] if unit == "output tok/s" else \
                medians["baseline"] / medians["this tree"]
            line += f": {faster:.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
