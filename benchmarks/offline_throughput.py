"""Offline throughput: kvserve beside transformers ``generate`` on one seeded workload, against the compute bound.

The workload: ``--num-requests`` requests of uniform random prompt lengths (token ids drawn from the ordinary
vocabulary, no special tokens) and uniform random output lengths, generated to exactly that length (greedy,
EOS ignored), all submitted at once. Each system is warmed up, then timed with ``time.perf_counter`` around the
whole workload; model loading is not timed. Systems:

    kvserve      LLM.generate over the whole workload (continuous batching, paged KV)
    hf-single    transformers generate, one request at a time
    hf-static8   transformers generate, static batches of 8 in submission order, left-padded; a batch runs to
                 its longest output and only the requested tokens count as output

The full measurement (the HF baselines take about 20 minutes on 2 cores: run it on a quiet machine)::

    python benchmarks/offline_throughput.py --json bench.json

A quick check while developing::

    python benchmarks/offline_throughput.py --num-requests 4 --max-prompt 64 --max-output 16 --profile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import transformers
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute_bound import ModelDims, compute_bound
from kvserve import LLM, SamplingParams
from kvserve.model.sources import resolve_model

SYSTEMS = ("kvserve", "hf-single", "hf-static8")
STATIC_BATCH_SIZE = 8
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    num_output_tokens: int


@dataclass(frozen=True)
class SystemResult:
    system: str
    wall_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.wall_s


# --- workload -------------------------------------------------------------------------------------------


def ordinary_token_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[int]:
    """Every id below ``vocab_size`` that is not an added (special or control) token."""
    added = set(tokenizer.added_tokens_decoder)
    return [i for i in range(min(vocab_size, len(tokenizer))) if i not in added]


def make_workload(
    num_requests: int, seed: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], token_ids: list[int]
) -> list[BenchRequest]:
    """Seeded requests: lengths uniform over the inclusive ranges, prompt ids uniform over ``token_ids``."""
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        prompt_len, output_len = rng.randint(*prompt_lens), rng.randint(*output_lens)
        workload.append(BenchRequest([rng.choice(token_ids) for _ in range(prompt_len)], output_len))
    return workload


def warmup_workload(token_ids: list[int]) -> list[BenchRequest]:
    return [BenchRequest(token_ids[:WARMUP_PROMPT_LEN], WARMUP_OUTPUT_LEN),
            BenchRequest(token_ids[-WARMUP_PROMPT_LEN // 2:], WARMUP_OUTPUT_LEN)]


def lengths(workload: Sequence[BenchRequest]) -> list[tuple[int, int]]:
    return [(len(r.prompt_token_ids), r.num_output_tokens) for r in workload]


def token_counts(workload: Sequence[BenchRequest]) -> tuple[int, int]:
    """(prompt tokens, output tokens) of the whole workload."""
    return sum(len(r.prompt_token_ids) for r in workload), sum(r.num_output_tokens for r in workload)


# --- systems --------------------------------------------------------------------------------------------


def hf_pretrained_args(model: str) -> tuple[str, dict[str, str]]:
    """``from_pretrained`` arguments for kvserve's model string (a packaged name, a GGUF file or an HF dir)."""
    location = resolve_model(model)
    if location.kind == "gguf":
        return str(location.path.parent), {"gguf_file": location.path.name}
    return str(location.path), {}


def timed(
    system: str, run: Callable[[Sequence[BenchRequest]], None], workload: Sequence[BenchRequest],
    details: dict[str, Any] | None = None,
) -> SystemResult:
    start = time.perf_counter()
    run(workload)
    wall_s = time.perf_counter() - start
    return SystemResult(system, wall_s, *token_counts(workload), details or {})


def kvserve_params(request: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=request.num_output_tokens, ignore_eos=True, temperature=0)


def kvserve_generate(llm: LLM, workload: Sequence[BenchRequest]) -> None:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    outputs = llm.generate(prompts, [kvserve_params(r) for r in workload], use_tqdm=False)
    for request, output in zip(workload, outputs):
        num_generated = len(output.outputs[0].token_ids)
        assert num_generated == request.num_output_tokens, (num_generated, request.num_output_tokens)


def load_kvserve(args: argparse.Namespace, token_ids: list[int]) -> LLM:
    llm = LLM(model=args.model, dtype="float32", max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs)
    kvserve_generate(llm, warmup_workload(token_ids))
    return llm


def run_kvserve(llm: LLM, workload: Sequence[BenchRequest]) -> SystemResult:
    result = timed("kvserve", lambda w: kvserve_generate(llm, w), workload)
    return dataclasses.replace(result, details={"stats": llm.stats()})


def hf_generate(model: PreTrainedModel, batch: Sequence[BenchRequest], pad_token_id: int) -> None:
    """One left-padded ``generate`` call; every row runs to the batch's longest output."""
    max_prompt = max(len(r.prompt_token_ids) for r in batch)
    num_new = max(r.num_output_tokens for r in batch)
    input_ids = torch.full((len(batch), max_prompt), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, request in enumerate(batch):
        input_ids[row, max_prompt - len(request.prompt_token_ids):] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, max_prompt - len(request.prompt_token_ids):] = 1
    out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                         max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, pad_token_id=pad_token_id)
    assert out.shape == (len(batch), max_prompt + num_new), (tuple(out.shape), max_prompt + num_new)


def hf_batches(workload: Sequence[BenchRequest], batch_size: int) -> list[Sequence[BenchRequest]]:
    return [workload[i:i + batch_size] for i in range(0, len(workload), batch_size)]


def run_hf(system: str, model: PreTrainedModel, workload: Sequence[BenchRequest], pad_token_id: int) -> SystemResult:
    batch_size = STATIC_BATCH_SIZE if system == "hf-static8" else 1

    def run(w: Sequence[BenchRequest]) -> None:
        for batch in hf_batches(w, batch_size):
            hf_generate(model, batch, pad_token_id)

    num_generated = sum(max(r.num_output_tokens for r in b) * len(b) for b in hf_batches(workload, batch_size))
    return timed(system, run, workload, {"batch_size": batch_size, "num_generated_incl_padding": num_generated})


def load_hf(model: str, pad_token_id: int, token_ids: list[int]) -> PreTrainedModel:
    path, kwargs = hf_pretrained_args(model)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    hf_generate(hf_model, warmup_workload(token_ids), pad_token_id)
    return hf_model


# --- profile --------------------------------------------------------------------------------------------

# Ops called from Python, grouped by name; ops nested inside them count toward their caller.
OP_GROUPS = {
    "GEMMs": {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::baddbmm"},
    "attention + KV": {"aten::scaled_dot_product_attention", "aten::index_select", "aten::index_copy_",
                       "aten::index_put_", "aten::gather"},
    "sampling": {"aten::argmax", "aten::topk", "aten::sort", "aten::softmax", "aten::log_softmax",
                 "aten::multinomial"},
}


def op_group(name: str) -> str:
    return next((group for group, names in OP_GROUPS.items() if name in names), "other ops")


def top_level_ops(events: Sequence[FunctionEvent]) -> list[FunctionEvent]:
    """aten ops called from Python: their inclusive times add up without counting nested ops twice."""
    return [e for e in events if e.name.startswith("aten::") and not _has_aten_ancestor(e)]


def _has_aten_ancestor(event: FunctionEvent) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def profile_kvserve(llm: LLM, workload: Sequence[BenchRequest], every: int) -> dict[str, Any]:
    """Where kvserve's step time goes on ``workload``: every ``every``-th engine step runs under torch.profiler
    (CPU ops, no shapes), so both the prefill-heavy start and the decode-only tail are sampled while the
    trace stays small enough to parse. Op time is grouped by name; the rest of those steps' wall time is
    Python/framework overhead (the profiler's own small per-op cost included)."""
    for i, request in enumerate(workload):
        llm.engine.add_request(f"profile-{i}", {"prompt_token_ids": request.prompt_token_ids},
                               kvserve_params(request))
    groups = dict.fromkeys([*OP_GROUPS, "other ops"], 0.0)

    def collect(prof: profile) -> None:
        for event in top_level_ops(prof.events()):
            groups[op_group(event.name)] += event.cpu_time_total / 1e6

    # each cycle of ``every`` steps: wait, one warm-up step, then one recorded step
    schedule = torch.profiler.schedule(wait=every - 2, warmup=1, active=1)
    num_steps, profiled_wall_s = 0, 0.0
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule, on_trace_ready=collect) as prof:
        while llm.engine.has_unfinished_requests():
            start = time.perf_counter()
            llm.engine.step()
            if num_steps % every == every - 1:
                profiled_wall_s += time.perf_counter() - start
            num_steps += 1
            prof.step()
    groups["Python/framework"] = profiled_wall_s - sum(groups.values())
    return {"num_steps": num_steps, "num_profiled_steps": num_steps // every, "wall_s": profiled_wall_s,
            "groups_s": groups}


# --- report ---------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
    flags = fields.get("Flags", "").split()
    return {
        "cpu": fields.get("Model name", platform.processor()),
        "num_cpus": os.cpu_count(),
        "isa": [f for f in flags if f in ("avx2", "fma") or f.startswith("avx512")],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def results_table(results: list[SystemResult], bound_s: float) -> str:
    kvserve = next((r for r in results if r.system == "kvserve"), None)
    lines = ["| system | wall s | output tok/s | total tok/s | share of compute bound | kvserve speed-up |",
             "|---|---|---|---|---|---|"]
    for r in results:
        speedup = f"{kvserve.total_tokens_per_s / r.total_tokens_per_s:.2f}x" if kvserve else "-"
        lines.append(f"| {r.system} | {r.wall_s:.1f} | {r.output_tokens_per_s:.1f} | {r.total_tokens_per_s:.1f} "
                     f"| {bound_s / r.wall_s:.0%} | {speedup} |")
    return "\n".join(lines)


def profile_table(profile_result: dict[str, Any]) -> str:
    wall = profile_result["wall_s"]
    if not profile_result["num_profiled_steps"]:
        return f"kvserve ran {profile_result['num_steps']} steps, fewer than --profile-every: none was profiled"
    lines = [f"kvserve step time: {profile_result['num_profiled_steps']} of {profile_result['num_steps']} steps "
             f"profiled, {wall:.2f} s", "", "| where | s | share |", "|---|---|---|"]
    lines += [f"| {group} | {s:.2f} | {s / wall:.0%} |" for group, s in profile_result["groups_s"].items()]
    return "\n".join(lines)


def print_report(report: dict[str, Any], results: list[SystemResult]) -> None:
    bound = report["compute_bound"]
    print(f"\nmachine: {json.dumps(report['machine'])}")
    print(f"workload: {json.dumps(report['workload'])}")
    for name, rate in bound["gemm_rates"].items():
        print(f"  GEMM {name:>12} {str(rate['shape']):>20}: {rate['flops_per_s'] / 1e9:7.1f} GFLOP/s")
    print(f"compute bound: {bound['flops'] / 1e12:.2f} TFLOP at {bound['peak_flops_per_s'] / 1e9:.1f} GFLOP/s "
          f"= {bound['bound_s']:.1f} s\n")
    if results:
        print(results_table(results, bound["bound_s"]))
    if "kvserve" in report["systems"]:
        print(f"\nkvserve KV cache: {json.dumps(report['systems']['kvserve']['details']['stats'])}")
    if "profile" in report:
        print("\n" + profile_table(report["profile"]))


def speedups(results: list[SystemResult]) -> dict[str, float]:
    """kvserve's total tokens/s over each baseline's (the same workload, so also the ratio of wall times)."""
    kvserve = next((r for r in results if r.system == "kvserve"), None)
    if kvserve is None:
        return {}
    return {r.system: kvserve.total_tokens_per_s / r.total_tokens_per_s for r in results if r is not kvserve}


def system_json(result: SystemResult, bound_s: float) -> dict[str, Any]:
    return {**dataclasses.asdict(result), "output_tokens_per_s": result.output_tokens_per_s,
            "total_tokens_per_s": result.total_tokens_per_s, "share_of_compute_bound": bound_s / result.wall_s}


# --- main -----------------------------------------------------------------------------------------------


def parse_systems(value: str) -> list[str]:
    systems = [s for s in value.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    return systems


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="packaged name, GGUF file or HF directory")
    p.add_argument("--systems", type=parse_systems, default=list(SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (empty: only the bound and --profile)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="also profile kvserve's steps on the workload")
    p.add_argument("--profile-every", type=int, default=10, help="profile one engine step in this many (>= 2)")
    p.add_argument("--json", type=Path, help="write the full report here")
    args = p.parse_args(argv)
    if not 1 <= args.min_prompt <= args.max_prompt or not 1 <= args.min_output <= args.max_output:
        p.error("length ranges need 1 <= --min-* <= --max-*")
    if args.num_requests < 1 or args.profile_every < 2:
        p.error("--num-requests must be >= 1 and --profile-every >= 2")
    return args


def run_systems(args: argparse.Namespace, workload: list[BenchRequest], token_ids: list[int],
                pad_token_id: int, report: dict[str, Any]) -> list[SystemResult]:
    results = []
    if "kvserve" in args.systems or args.profile:
        llm = load_kvserve(args, token_ids)
        if "kvserve" in args.systems:
            results.append(run_kvserve(llm, workload))
        if args.profile:
            report["profile"] = profile_kvserve(llm, workload, args.profile_every)
        del llm  # free its KV cache before transformers loads a second copy of the model
    hf_systems = [s for s in args.systems if s.startswith("hf-")]
    if hf_systems:
        hf_model = load_hf(args.model, pad_token_id, token_ids)
        results += [run_hf(system, hf_model, workload, pad_token_id) for system in hf_systems]
    return results


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    path, kwargs = hf_pretrained_args(args.model)
    hf_config = transformers.AutoConfig.from_pretrained(path, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **kwargs)
    token_ids = ordinary_token_ids(tokenizer, hf_config.vocab_size)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    workload = make_workload(args.num_requests, args.seed, (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), token_ids)
    bound = compute_bound(ModelDims.from_hf_config(hf_config), lengths(workload), args.max_num_batched_tokens)
    num_prompt, num_output = token_counts(workload)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "workload": {"model": args.model, "num_requests": args.num_requests, "seed": args.seed,
                     "prompt_lens": [args.min_prompt, args.max_prompt],
                     "output_lens": [args.min_output, args.max_output],
                     "num_prompt_tokens": num_prompt, "num_output_tokens": num_output,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs},
        "compute_bound": bound,
    }
    results = run_systems(args, workload, token_ids, pad_token_id, report)
    report["systems"] = {r.system: system_json(r, bound["bound_s"]) for r in results}
    report["kvserve_speedup"] = speedups(results)
    print_report(report, results)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
