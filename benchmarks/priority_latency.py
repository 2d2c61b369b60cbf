"""What ``--scheduling-policy priority`` buys an urgent request behind a batch of long, low-priority ones: its time
to first token and to its last, and what it costs the background's throughput, beside the default policy (lpm,
where every request has priority 0) in the same process, taking turns.

    python benchmarks/priority_latency.py --model smollm2-135m-instruct --rounds 3

Each round and policy: ``--background`` requests (priority 1 under ``priority``) of ``--background-len`` output
tokens fill every seat (``--max-num-seqs`` of them); once they all decode, an urgent request (priority 0) of
``--urgent-len`` tokens arrives every ``--every`` steps, ``--urgent`` of them (an engine per policy, the same
weights). Under lpm an urgent request waits for a seat; under priority it takes the seat of the lowest ranked
background request (the newest), which resumes later (by recompute: its prefix is cached). Greedy, fixed lengths (``ignore_eos``); wall-clock seconds on this machine's CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.bench.report import machine


def run(llm: LLM, args: argparse.Namespace, policy: str) -> dict[str, float]:
    engine = llm.engine
    low = 1 if policy == "priority" else 0
    background = SamplingParams(temperature=0, max_tokens=args.background_len, ignore_eos=True)
    urgent = SamplingParams(temperature=0, max_tokens=args.urgent_len, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 100 + args.prompt_len))}
    for i in range(args.background):
        engine.add_request(f"{policy}-bg{i}", {"prompt_token_ids": [7 + i, *prompt["prompt_token_ids"]]},
                           background, priority=low)
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    start, steps, next_urgent = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        if steps >= args.warm_steps and next_urgent < args.urgent and (steps - args.warm_steps) % args.every == 0:
            rid = f"{policy}-urgent{next_urgent}"
            engine.add_request(rid, {"prompt_token_ids": [3 + next_urgent, *prompt["prompt_token_ids"]]}, urgent)
            added[rid] = time.perf_counter()
            next_urgent += 1
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id in added and out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
        steps += 1
    wall = time.perf_counter() - start
    background_done = max(t for rid, t in done.items() if "-bg" in rid) - start
    return {
        "urgent_ttft_median_s": statistics.median(first[r] - added[r] for r in added),
        "urgent_ttft_max_s": max(first[r] - added[r] for r in added),
        "urgent_latency_median_s": statistics.median(done[r] - added[r] for r in added),
        "background_s": background_done,
        "background_tokens_per_s": args.background * args.background_len / background_done,
        "wall_s": wall,
        "preemptions": engine.core.scheduler.num_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--background", type=int, default=8)
    parser.add_argument("--background-len", type=int, default=192)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--urgent", type=int, default=6)
    parser.add_argument("--urgent-len", type=int, default=16)
    parser.add_argument("--every", type=int, default=20, help="steps between urgent arrivals")
    parser.add_argument("--warm-steps", type=int, default=10, help="steps before the first urgent arrival")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llms = {policy: LLM(args.model, max_num_seqs=args.max_num_seqs, scheduling_policy=policy)
            for policy in ("lpm", "priority")}
    host = machine()
    print(f"# {host['cpu']} ({host['num_cpus']} CPUs), {args.model}, max_num_seqs={args.max_num_seqs}, "
          f"{args.background} x {args.background_len} background tokens, {args.urgent} urgent x {args.urgent_len}")
    for policy, llm in llms.items():  # a first run of each loads kernels and records step graphs: not counted
        run(llm, argparse.Namespace(**{**vars(args), "urgent": 1, "background_len": 12, "warm_steps": 2}), policy)
    results: dict[str, list[dict[str, float]]] = {"lpm": [], "priority": []}
    for _ in range(args.rounds):
        for policy, llm in llms.items():
            before = llm.engine.core.scheduler.num_preemptions
            result = run(llm, args, policy)
            result["preemptions"] -= before
            results[policy].append(result)
            print(policy, {k: round(v, 3) for k, v in result.items()}, flush=True)
    for key in results["lpm"][0]:
        lpm = statistics.median(r[key] for r in results["lpm"])
        prio = statistics.median(r[key] for r in results["priority"])
        ratio = f"{prio / lpm:.2f}x" if lpm else "-"
        print(f"{key:28s} lpm {lpm:9.3f}  priority {prio:9.3f}  priority/lpm {ratio}")


if __name__ == "__main__":
    main()
