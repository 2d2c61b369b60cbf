"""``kvserve bench throughput``: a workload through the offline API, beside transformers in the same run.

Systems: ``kvserve`` (``LLM.generate`` over the whole workload) and transformers in the modes of
``hf_backend`` (one at a time, static batches, continuous batching). Every system gets the same token ids
and generates greedily exactly the requested number of tokens (EOS ignored), and each checks that it did, so
the token counts are the workload's: prompt ids as sent and outputs as requested. Each system is warmed up,
then timed around the whole workload (``time.perf_counter``, synchronized on CUDA); model loading is not timed.

Each system's figures are stated as ratios to the others' and as a share of the compute bound: its FLOPs
(``roofline.workload_flops``) over the best GEMM rate measured at the start of the run, in the engine's dtype.
``multiturn`` runs turn by turn: every conversation's next message resends the whole history with the
system's own previous answers in place of the scripted ones, so a turn starts when the previous turn of every
conversation is done.
``--profile`` reruns kvserve (a fresh engine, so the first run's prefix cache does not help it, and eager, so
that its C kernels' ranges are recorded) with one engine step in ``--profile-every`` under ``torch.profiler``,
and splits those steps' time by kind of op.
``--step-trace`` times kvserve's measured run step by step as each step's tokens come back, and splits the time
by the steps' shapes (``step_trace``): on a GPU, where the profiler's CPU ops say little.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve import LLM, SamplingParams
from kvserve.bench import hf_backend, roofline
from kvserve.bench.hf_backend import HF_MODES, Generate
from kvserve.bench.datasets import SampleRequest, add_dataset_arguments, build_dataset
from kvserve.bench.report import check_output_path, write_result_json
from kvserve.bench.serve import with_answers
from kvserve.bench.step_profile import StepProfile, format_profile
from kvserve.bench.step_trace import StepTrace, format_step_trace
from kvserve.device import parse_dtype, resolve_device
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.stats_counters import COUNTER_STATS
from kvserve.engine_args import EngineArgs
from kvserve.model.loader import load_checkpoint
from kvserve.model.sources import resolve_model

BACKENDS = ("kvserve", "hf")
WARMUP_OUTPUT_LEN = 4
HF_BATCH_SIZE = 8  # --hf-batch-size's default
PROFILE_EVERY = 10  # --profile-every's default


@dataclass(frozen=True)
class SystemResult:
    system: str
    wall_s: float
    lengths: list[tuple[int, int]]  # (prompt tokens, output tokens) of every request sent, in order
    bound_s: float  # the compute bound of this system's requests
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(p for p, _ in self.lengths)

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.lengths)

    def figures(self) -> dict[str, Any]:
        """Counts and rates under the names ``kvserve bench serve`` and ``compare`` use."""
        total = self.num_prompt_tokens + self.num_output_tokens
        return {
            "duration_s": self.wall_s, "completed": len(self.lengths),
            "input_tokens": self.num_prompt_tokens, "output_tokens": self.num_output_tokens,
            "request_throughput": len(self.lengths) / self.wall_s,
            "input_throughput": self.num_prompt_tokens / self.wall_s,
            "output_throughput": self.num_output_tokens / self.wall_s,
            "total_throughput": total / self.wall_s,
            "share_of_compute_bound": roofline.fraction_of_bound(total / self.wall_s, total / self.bound_s),
        }


# ------------------------------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="kvserve",
                        help=f"comma-separated, of {', '.join(BACKENDS)} (default: %(default)s)")
    parser.add_argument("--hf-mode", default=",".join(HF_MODES),
                        help=f"transformers modes for --backend hf, comma-separated, of {', '.join(HF_MODES)} "
                             "(default: all)")
    parser.add_argument("--hf-batch-size", type=int, default=HF_BATCH_SIZE,
                        help="batch size of --hf-mode static (default: %(default)s)")
    parser.add_argument("--profile", action="store_true", help="also profile kvserve's engine steps")
    parser.add_argument("--profile-every", type=int, default=PROFILE_EVERY,
                        help="profile one engine step in this many (>= 2; default: %(default)s)")
    parser.add_argument("--step-trace", action="store_true",
                        help="time each kvserve step as its tokens come back and fit the times to the steps' shapes")
    parser.add_argument("--label", default=None, help="a name for this run in tables and compare")
    parser.add_argument("--result-json", default=None)
    roofline.add_probe_arguments(parser)
    add_dataset_arguments(parser)
    EngineArgs.add_cli_args(parser, skip=("seed",))  # --seed is the workload's, and seeds the engine too


def selected_systems(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(backend, hf mode) pairs in the order given, each once; raises ValueError naming a bad flag."""
    backends = _split(args.backend, BACKENDS, "--backend")
    modes = _split(args.hf_mode, HF_MODES, "--hf-mode")
    if args.profile_every < 2:
        raise ValueError(f"--profile-every must be >= 2, got {args.profile_every}")
    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    _refuse_ignored(args, backends)
    return [(backend, mode) for backend in backends for mode in ([None] if backend == "kvserve" else modes)]


def _refuse_ignored(args: argparse.Namespace, backends: list[str]) -> None:
    """ValueError naming a flag the chosen systems would ignore: a run would read as what it did not measure."""
    ignored = {
        "--hf-mode": "hf" not in backends and args.hf_mode != ",".join(HF_MODES),
        "--hf-batch-size": "hf" not in backends and args.hf_batch_size != HF_BATCH_SIZE,
        "--profile-every": not args.profile and args.profile_every != PROFILE_EVERY,
        "--profile": "kvserve" not in backends and args.profile,
        "--step-trace": "kvserve" not in backends and args.step_trace,
    }
    given = [flag for flag, is_ignored in ignored.items() if is_ignored]
    if given:
        raise ValueError(f"{', '.join(given)}: ignored by this run (--hf-* need --backend hf, --profile and "
                         "--step-trace --backend kvserve, --profile-every --profile)")


def _split(value: str, allowed: Sequence[str], flag: str) -> list[str]:
    items = list(dict.fromkeys(item for item in value.split(",") if item))
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise ValueError(f"{flag} {value!r}: choose one or more of {', '.join(allowed)}")
    return items


# ------------------------------------------------------------------------------------------------------ main


def main(args: argparse.Namespace) -> int:
    systems = selected_systems(args)
    roofline.check_probe_arguments(args)
    if args.result_json is not None:
        check_output_path(args.result_json, "--result-json")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(resolve_device(args.device))
    dtype = parse_dtype(args.dtype, device.type)
    checkpoint = load_checkpoint(resolve_model(args.model), dtype, "dummy")  # its tokenizer and shapes only
    chat_template = EngineArgs.from_cli_args(args).create_engine_config().model.chat_template
    if chat_template is not None:  # the workloads are built and rendered with the run's template
        checkpoint.tokenizer.chat_template = chat_template
    chat = InputProcessor(checkpoint.tokenizer, checkpoint.hf_config.vocab_size, checkpoint.max_model_len)
    requests = tokenized(build_dataset(args, checkpoint.tokenizer, checkpoint.max_model_len), chat)
    size = roofline.ModelSize.from_hf_config(checkpoint.hf_config)
    gemm = roofline.measure_gemm_peak(size, dtype, device, roofline.gemm_size(args, device), args.gemm_tokens,
                                      args.num_repeats)
    bench = Bench(requests, chat, device, size, gemm["peak_flops_per_s"])
    results = run_systems(bench, systems, args, dtype)
    report = throughput_report(results, args, dtype, gemm)
    if args.profile:
        report["profile"] = profile_kvserve(bench, args)
    if args.result_json:  # first: a reader of the report that has gone (a pager quit) loses no finished run
        write_result_json(args.result_json, report, args)
    print(format_report(report, results))
    return 0


def throughput_report(results: list[SystemResult], args: argparse.Namespace, dtype: torch.dtype,
                      gemm: dict[str, Any]) -> dict[str, Any]:
    """Every figure of the run; the first system's also at the top level, where ``compare`` reads them."""
    return {
        "kind": "throughput", "label": args.label or f"{results[0].system} {args.dataset_name}",
        "workload": args.dataset_name, **results[0].figures(),
        "systems": {r.system: {**r.figures(), "compute_bound_s": r.bound_s, "details": r.details} for r in results},
        "ratios": throughput_ratios(results),
        "compute_bound": {"dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), **gemm},
    }


def tokenized(requests: list[SampleRequest], chat: InputProcessor) -> list[SampleRequest]:
    """Every prompt as the token ids kvserve's input processor makes of it, checked against the model's limits
    before anything is timed. Multiturn requests stay as they are: their history is known only as the run goes.
    """
    return [r if r.turn is not None else _as_token_ids(r, chat) for r in requests]


def _as_token_ids(request: SampleRequest, chat: InputProcessor) -> SampleRequest:
    """The prompt as ids; a grounded request's are its messages through the chat template, as the server's chat
    route makes them (its prompt text, tokenized again, would add a second BOS where the template writes one), and
    it drops the messages."""
    if request.messages is not None:
        prompt = {"prompt_token_ids": chat.apply_chat_template(request.messages)["prompt_token_ids"]}
    else:
        prompt = request.prompt if isinstance(request.prompt, str) else {"prompt_token_ids": request.prompt}
    token_ids = chat.process(prompt, greedy_exact(request)).prompt_token_ids
    return dataclasses.replace(request, prompt=token_ids, prompt_len=len(token_ids), messages=None)


# ------------------------------------------------------------------------------------------------------ runs


@dataclass(frozen=True)
class Bench:
    """What every system runs and is measured against."""

    requests: list[SampleRequest]  # prompts as token ids, or chat histories (multiturn)
    chat: InputProcessor  # the chat template for multiturn, and the tokenizer that decodes answers
    device: torch.device
    size: roofline.ModelSize
    peak_flops_per_s: float

    def warmup_requests(self) -> list[SampleRequest]:
        """Two short prompts of their own (under one KV block: nothing they cache can help the run)."""
        ids = [self.chat.tokenizer.encode(f"Warm-up request {i}: say something.") for i in range(2)]
        return [SampleRequest(p, len(p), WARMUP_OUTPUT_LEN) for p in ids]

    def measure(self, system: str, generate: Generate) -> SystemResult:
        """Warm up, then time the workload."""
        self.warm_up(generate)
        return self.timed(system, generate)

    def warm_up(self, generate: Generate) -> None:
        generate(self.warmup_requests())
        self._sync()

    def timed(self, system: str, generate: Generate) -> SystemResult:
        """The workload, timed (after a warm-up: ``measure``), less what the runner counts as no generation of its
        own (``hf_backend.ContinuousBatching.untimed_s``: transformers' session shutdowns)."""
        untimed_before = getattr(generate, "untimed_s", 0.0)
        start = time.perf_counter()
        lengths = run_workload(generate, self.requests, self.chat)
        self._sync()
        wall_s = time.perf_counter() - start - (getattr(generate, "untimed_s", 0.0) - untimed_before)
        bound_s = roofline.workload_flops(self.size, lengths) / self.peak_flops_per_s
        return SystemResult(system, wall_s, lengths, bound_s)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_workload(generate: Generate, requests: list[SampleRequest], chat: InputProcessor) -> list[tuple[int, int]]:
    """Run every request; returns the (prompt, output) lengths of what was sent, in the requests' order for a
    plain workload and turn by turn for multiturn."""
    if all(r.messages is None for r in requests):
        _checked(generate(requests), requests)
        return [(len(r.prompt), r.output_len) for r in requests]
    return _run_turns(generate, requests, chat)


def _run_turns(generate: Generate, requests: list[SampleRequest], chat: InputProcessor) -> list[tuple[int, int]]:
    """Turn t of every conversation in one call, its history holding this system's answers to turns < t."""
    answers: dict[int | None, list[str]] = defaultdict(list)
    lengths = []
    for turn in sorted({r.turn or 0 for r in requests}):
        batch = [r for r in requests if (r.turn or 0) == turn]
        prompts = []
        for r in batch:
            ids = chat.apply_chat_template(with_answers(r.messages, answers[r.group]))["prompt_token_ids"]
            prompts.append(dataclasses.replace(r, prompt=ids, prompt_len=len(ids), messages=None))
        for r, output in zip(batch, _checked(generate(prompts), prompts)):
            answers[r.group].append(chat.tokenizer.decode(output, skip_special_tokens=True))
        lengths += [(len(r.prompt), r.output_len) for r in prompts]
    return lengths


def _checked(outputs: list[list[int]], requests: Sequence[SampleRequest]) -> list[list[int]]:
    for i, (output, request) in enumerate(zip(outputs, requests, strict=True)):
        if len(output) != request.output_len:
            raise RuntimeError(f"request {i} got {len(output)} tokens, {request.output_len} were asked for")
    return outputs


def run_systems(bench: Bench, systems: list[tuple[str, str | None]], args: argparse.Namespace,
                dtype: torch.dtype) -> list[SystemResult]:
    """kvserve first (the baseline of compare), then the transformers modes in the order given; one model in
    memory at a time (kvserve's engine is freed before transformers loads)."""
    results = []
    if ("kvserve", None) in systems:
        results.append(run_kvserve(bench, args))
        gc.collect()  # the engine's reference cycles: its weights and KV pool go before transformers loads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    modes = [mode for backend, mode in systems if backend == "hf"]
    if modes:
        model = hf_backend.load_hf_model(args.model, dtype, bench.device, dummy=args.load_format == "dummy")
        tokenizer = bench.chat.tokenizer
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        for mode in modes:
            generate = hf_backend.hf_generator(model, mode, pad_token_id=pad_token_id, batch_size=args.hf_batch_size,
                                               max_batch_tokens=args.max_num_batched_tokens,
                                               max_num_seqs=args.max_num_seqs)
            results.append(bench.measure(hf_backend.system_name(mode, args.hf_batch_size), generate))
    return results


def run_kvserve(bench: Bench, args: argparse.Namespace) -> SystemResult:
    """kvserve's run, its engine closed at the end and no reference to it left: a function of its own, so that
    nothing of it outlives the call (a closure over the LLM kept a 100 GiB KV pool alive on the GPU)."""
    with load_kvserve(args) as llm:
        trace = StepTrace() if args.step_trace else None
        llm.engine.observe_steps(trace)
        generate = kvserve_generator(llm, trace)
        bench.warm_up(generate)
        before = llm.stats()  # after the warm-up, so that the run's counters leave it out
        result = bench.timed("kvserve", generate)
        details = {"stats": run_stats(before, llm.stats())}
    if trace is not None:
        details["step_trace"] = trace.summary()
        print(format_step_trace(details["step_trace"]), flush=True)
    return dataclasses.replace(result, details=details)


def load_kvserve(args: argparse.Namespace, **overrides: Any) -> LLM:
    """The engine ``args`` describe, with ``overrides`` of its keyword arguments."""
    return LLM(**{**dataclasses.asdict(EngineArgs.from_cli_args(args)), **overrides})


def greedy_exact(request: SampleRequest) -> SamplingParams:
    return SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0)


def kvserve_generator(llm: LLM, trace: StepTrace | None = None) -> Generate:
    def generate(requests: Sequence[SampleRequest]) -> list[list[int]]:
        if trace is not None:
            trace.new_segment()
        outputs = llm.generate([{"prompt_token_ids": r.prompt} for r in requests], [greedy_exact(r) for r in requests])
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate


def run_stats(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``llm.stats()`` after the run, its counters counted from ``before`` (the warm-up left out), the prefix
    cache's hit rate and speculation's acceptance rate from them; the KV peak (the warm-up's is smaller than any
    real run's) and the copies' bandwidths are since the engine started."""
    stats = {**after, **{name: after[name] - before[name] for name in COUNTER_STATS if name in after}}
    if "prefix_cache_queries" in stats:
        queries = stats["prefix_cache_queries"]
        stats["prefix_cache_hit_rate"] = stats["prefix_cache_hits"] / queries if queries else 0.0
    if "spec_decode_num_draft_tokens" in stats:
        drafted = stats["spec_decode_num_draft_tokens"]
        stats["spec_decode_acceptance_rate"] = stats["spec_decode_num_accepted_tokens"] / drafted if drafted else 0.0
    return stats


def throughput_ratios(results: list[SystemResult]) -> dict[str, dict[str, float]]:
    """``ratios[a][b]``: a's total tokens/s over b's (on one workload, also b's wall time over a's)."""
    rate = {r.system: r.figures()["total_throughput"] for r in results}
    return {a: {b: rate[a] / rate[b] for b in rate} for a in rate}


# --------------------------------------------------------------------------------------------------- profile

def profile_kvserve(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """The workload on a fresh engine with every ``args.profile_every``-th step under torch.profiler (CPU ops,
    no shapes), so both the prefill-heavy start and the decode-only tail are sampled while the trace stays
    small enough to parse. Eager: a step graph replays the kernels' calls without their profiler ranges, and
    its steps' time would all read as Python/framework overhead."""
    llm = load_kvserve(args, enforce_eager=True)
    step_profile = StepProfile(args.profile_every)
    run_workload(profiled_generator(llm, step_profile), bench.requests, bench.chat)
    return step_profile.summary()


def profiled_generator(llm: LLM, step_profile: StepProfile) -> Generate:
    """Drives the engine step by step (``LLM.generate`` hides its steps); each cycle of ``every`` steps waits,
    runs one warm-up step of the profiler, then records one."""
    every = step_profile.every
    schedule = torch.profiler.schedule(wait=every - 2, warmup=1, active=1)

    def generate(requests: Sequence[SampleRequest]) -> list[list[int]]:
        step_profile.num_calls += 1
        ids = [f"profile-{step_profile.num_calls}-{i}" for i in range(len(requests))]
        for rid, request in zip(ids, requests):
            llm.engine.add_request(rid, {"prompt_token_ids": request.prompt}, greedy_exact(request))
        finished: dict[str, list[int]] = {}
        step = 0
        # each cycle's events go to ``collect`` as it ends (torch warns that it then clears them: as intended)
        with profile(activities=[ProfilerActivity.CPU], schedule=schedule,
                     on_trace_ready=step_profile.collect) as prof:
            while llm.engine.has_unfinished_requests():
                start = time.perf_counter()
                outputs = llm.engine.step()
                if step % every == every - 1:
                    step_profile.wall_s += time.perf_counter() - start
                    step_profile.num_profiled_steps += 1
                finished.update({o.request_id: list(o.outputs[0].token_ids) for o in outputs if o.finished})
                prof.step()
                step += 1
        step_profile.num_steps += step
        return [finished[rid] for rid in ids]

    return generate


# ---------------------------------------------------------------------------------------------------- report


def format_report(report: dict[str, Any], results: list[SystemResult]) -> str:
    first = results[0]
    bound = report["compute_bound"]
    lines = [f"== {report['label']} ==",
             f"workload {report['workload']}: {len(first.lengths)} requests, {first.num_prompt_tokens} prompt + "
             f"{first.num_output_tokens} output tokens",
             f"compute bound: peak {bound['dtype']} GEMM {bound['peak_flops_per_s'] / 1e9:.1f} GFLOP/s, "
             f"{first.bound_s:.3g} s for this workload",
             f"{'system':<20}{'wall s':>9}{'req/s':>9}{'input tok/s':>13}{'output tok/s':>14}{'total tok/s':>13}"
             f"{'of bound':>10}"]
    for r in results:
        f = r.figures()
        lines.append(f"{r.system:<20}{r.wall_s:>9.2f}{f['request_throughput']:>9.2f}{f['input_throughput']:>13.1f}"
                     f"{f['output_throughput']:>14.1f}{f['total_throughput']:>13.1f}"
                     f"{f['share_of_compute_bound']:>10.1%}")
    if len(results) > 1:
        lines.append("total tok/s, row over column:")
        lines.append(f"{'':<20}" + "".join(f"{r.system:>20}" for r in results))
        for a, row in report["ratios"].items():
            lines.append(f"{a:<20}" + "".join(f"{ratio:>19.2f}x" for ratio in row.values()))
    if "kvserve" in report["systems"]:
        lines.append(format_stats(report["systems"]["kvserve"]["details"]["stats"]))
    if "profile" in report:
        lines.append(format_profile(report["profile"]))
    return "\n".join(lines)


def format_stats(stats: dict[str, Any]) -> str:
    line = (f"kvserve KV cache: peak {stats['peak_num_blocks_used']} of {stats['num_blocks_total']} blocks of "
            f"{stats['block_size']} ({stats['kv_cache_dtype']}), waste at peak {stats['kv_waste_at_peak']:.1%}, "
            f"preemptions {stats['num_preemptions']}")
    if stats.get("prefix_caching"):
        line += (f", prefix-cache hit rate {stats['prefix_cache_hit_rate']:.1%} ({stats['prefix_cache_hits']} of "
                 f"{stats['prefix_cache_queries']} tokens looked up), evictions {stats['prefix_cache_evictions']}")
    if "spec_decode_num_draft_tokens" in stats:
        line += (f", speculation: {stats['spec_decode_num_accepted_tokens']} of "
                 f"{stats['spec_decode_num_draft_tokens']} draft tokens accepted "
                 f"({stats['spec_decode_acceptance_rate']:.1%})")
    return line
