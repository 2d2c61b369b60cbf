"""Structured output's cost: output throughput with every request under a JSON schema against the same workload
free, at 16 streams (one schema) and at 64 streams (8 distinct schemas), with the per-step mask time; and the
time to compile a typical schema, cold and cached.

    PYTHONPATH=. python benchmarks/structured_output.py [--model smollm2-135m-instruct] [--rounds 2]
    # on a GPU, the overlapped scheduler (whose continued steps draw a grammar's rows after the step before is
    # read back) against scheduling each step after the last, at SmolLM2's shape with dummy weights:
    python benchmarks/structured_output.py --model SHAPE_DIR --load-format dummy --device cuda [--no-overlap-scheduling]

Offline through ``LLM`` with ``--max-num-seqs`` streams and as many requests; every request generates exactly
``--max-tokens`` tokens (``ignore_eos``: a finished constraint then allows only EOS, so constrained rows keep
their masks to the end and both runs do the same number of steps of the same size). Free and constrained runs
alternate for ``--rounds`` rounds and the best of each is kept, so both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import time

from kvserve import LLM, SamplingParams, StructuredOutputsParams


def schema(i: int) -> dict:
    """The i-th of the distinct schemas: a record with a list of items, long enough not to end early."""
    return {
        "type": "object",
        "properties": {
            f"title_{i}": {"type": "string"},
            "items": {"type": "array", "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "count": {"type": "integer", "minimum": 0},
                               "kind": {"enum": ["a", "b", f"c{i}"]}},
                "required": ["name", "count", "kind"]}},
        },
        "required": [f"title_{i}", "items"],
    }


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def measure(llm: LLM, streams: int, num_schemas: int, max_tokens: int, rounds: int) -> dict:
    prompts = [f"Write inventory record {i} as JSON, with a title and a list of items." for i in range(streams)]
    free = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                  structured_outputs=StructuredOutputsParams(json=schema(i % num_schemas)))
                   for i in range(streams)]
    grammar = llm.engine.core.runner.grammar
    best = {"free": 0.0, "json": 0.0}
    for _ in range(rounds):
        seconds, tokens = run(llm, prompts, [free] * streams)
        best["free"] = max(best["free"], tokens / seconds)
        stats_before = (grammar.stats.steps, grammar.stats.fill_seconds, grammar.stats.wait_seconds)
        seconds, tokens = run(llm, prompts, constrained)
        best["json"] = max(best["json"], tokens / seconds)
        steps = grammar.stats.steps - stats_before[0]
        fill_ms = (grammar.stats.fill_seconds - stats_before[1]) / steps * 1e3
        wait_ms = (grammar.stats.wait_seconds - stats_before[2]) / steps * 1e3
    return {"streams": streams, "schemas": num_schemas, "free_tok_s": round(best["free"], 1),
            "json_tok_s": round(best["json"], 1), "ratio": round(best["json"] / best["free"], 3),
            "mask_fill_ms_per_step": round(fill_ms, 3), "mask_wait_ms_per_step": round(wait_ms, 3),
            "steps_scheduled_ahead": llm.stats()["num_steps_scheduled_ahead"]}


def compile_times(llm: LLM) -> dict:
    compiler = llm.engine.core.runner.grammar.compiler
    spec = StructuredOutputsParams(json=schema(1000))
    start = time.perf_counter()
    compiler.compile(spec)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(spec)
    return {"compile_cold_ms": round(cold * 1e3, 2), "compile_cached_ms": round((time.perf_counter() - start) * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loads", default="16:1,64:8", help="streams:distinct schemas, comma-separated")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (a --config-only shape)")
    parser.add_argument("--no-overlap-scheduling", action="store_true",
                        help="schedule each step after the one before is read back (the overlap is on on CUDA)")
    args = parser.parse_args()
    options = {"device": args.device, "load_format": args.load_format}
    if args.no_overlap_scheduling:
        options["overlap_scheduling"] = False
    for load in args.loads.split(","):
        streams, num_schemas = map(int, load.split(":"))
        llm = LLM(args.model, max_num_seqs=streams, **options)
        llm.generate(["warm up"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            json=schema(999))))
        print(json.dumps(measure(llm, streams, num_schemas, args.max_tokens, args.rounds)), flush=True)
    print(json.dumps(compile_times(llm)))


if __name__ == "__main__":
    main()
