"""``kvserve bench serve``: drive any OpenAI-compatible server with a workload and report what it did."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import torch
from tqdm import tqdm

from kvserve.bench.client import LoadShape, Target, run_workload, scrape_metrics
from kvserve.bench.report import write_result_json
from kvserve.bench.summary import format_table, parse_goodput, summarize
from kvserve.bench.workloads import SampleRequest, Workload, add_workload_arguments, build_workload
from kvserve.config import DEFAULT_MODEL
from kvserve.model.loader import load_checkpoint
from kvserve.model.sources import resolve_model

NUM_WARMUP_TOKENS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the model name the server answers to")
    parser.add_argument("--tokenizer", default=None,
                        help="where to read the tokenizer that builds prompts (default: --model, resolved as kvserve "
                             "resolves a model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--label", default=None, help="a name for this run in tables and compare")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals per second (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--num-warmups", type=int, default=2, help="short requests sent before timing")
    parser.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:100 (ms)")
    parser.add_argument("--result-json", default=None)
    add_workload_arguments(parser)


def main(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    tokenizer = load_checkpoint(resolve_model(args.tokenizer or args.model), torch.float32).tokenizer
    workload = build_workload(args, tokenizer)
    target = Target(args.base_url, args.model, args.api_key)
    summary = asyncio.run(_measure(target, workload, args))
    summary.update(summarize(summary.pop("results"), summary.pop("duration"), slos))
    label = args.label or f"{args.base_url} {workload.name}"
    print(format_table(summary, label))
    if args.result_json:
        write_result_json(args.result_json, {"kind": "serve", "label": label, **summary}, args)
    return 0 if summary["completed"] else 1


async def _measure(target: Target, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    await _warm_up(target, args.num_warmups)
    before = await scrape_metrics(target.base_url)
    shape = LoadShape(args.request_rate, args.max_concurrency, args.seed)
    total = len(workload.requests) or sum(len(c.user_turns) for c in workload.conversations)
    with tqdm(total=total, desc=f"bench serve {workload.name}", unit="req") as progress:
        results, duration = await run_workload(target, workload, shape, progress)
    after = await scrape_metrics(target.base_url)
    moved = {name: after[name] - before.get(name, 0.0) for name in after if name.startswith("kvserve:prefix_cache")}
    return {"results": results, "duration": duration, "server_prefix_cache_metrics": moved}


async def _warm_up(target: Target, num_warmups: int) -> None:
    """A few short requests, untimed, with their own prompts, so that nothing they cache helps the run."""
    if num_warmups <= 0:
        return
    warmup = Workload("warmup", [SampleRequest(f"Warm-up request {i}: say something.", 8, NUM_WARMUP_TOKENS)
                                 for i in range(num_warmups)])
    results, _ = await run_workload(target, warmup, LoadShape())
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"warm-up failed against {target.base_url}: {failed[0]}")
