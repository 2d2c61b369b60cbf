"""From per-request timings to the figures a serving benchmark reports: throughput, latency percentiles,
goodput under SLOs, failures, prefix-cache hit rate."""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import numpy as np

from kvserve.bench.client import RequestResult

PERCENTILES = {"mean": None, "median": 50, "p90": 90, "p99": 99, "max": 100}
SLO_METRICS = ("ttft", "tpot", "e2e")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:100"]`` -> SLOs in seconds; names ttft, tpot, e2e, values in ms."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            slos[name] = float(value) / 1000
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return slos


def distribution_ms(values: Sequence[float]) -> dict[str, float] | None:
    """Mean, median, P90, P99 and max in milliseconds; None when there are no values."""
    if not len(values):
        return None
    array = np.asarray(values, dtype=np.float64) * 1000
    return {name: float(array.mean() if q is None else np.percentile(array, q)) for name, q in PERCENTILES.items()}


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft, "tpot": result.tpot, "e2e": result.e2e}
    return result.ok and all(measured[name] is None or measured[name] <= limit for name, limit in slos.items())


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Every figure of a run, from its results and its wall time in seconds."""
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    summary: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in done]),
        "prefix_cache_hit_rate": _hit_rate(done),
    }
    if slos:
        summary["goodput_slos_ms"] = {name: limit * 1000 for name, limit in slos.items()}
        summary["goodput"] = sum(meets(r, slos) for r in results) / duration
    turns = sorted({r.turn for r in done if r.turn is not None})
    if turns:
        summary["ttft_ms_by_turn"] = {
            str(turn): distribution_ms([r.ttft for r in done if r.turn == turn and r.ttft is not None])
            for turn in turns
        }
        summary["prompt_tokens_by_turn"] = {
            str(turn): float(np.mean([r.prompt_tokens for r in done if r.turn == turn])) for turn in turns
        }
    return summary


def _hit_rate(done: list[RequestResult]) -> float | None:
    """Cached prompt tokens over prompt tokens, from the servers' usage; None if the server does not say."""
    if not done or any(r.cached_tokens is None for r in done):
        return None
    prompt = sum(r.prompt_tokens for r in done)
    return sum(r.cached_tokens or 0 for r in done) / prompt if prompt else None


def format_table(summary: dict[str, Any], title: str) -> str:
    lines = [f"== {title} ==",
             f"completed {summary['completed']}, failed {summary['failed']}, {summary['duration_s']:.2f} s"]
    for error, count in summary["errors"].items():
        lines.append(f"  error x{count}: {error}")
    lines.append(
        f"throughput: {summary['request_throughput']:.3f} req/s, input {summary['input_throughput']:.1f}, "
        f"output {summary['output_throughput']:.1f}, total {summary['total_throughput']:.1f} tok/s"
    )
    if "goodput" in summary:
        lines.append(f"goodput: {summary['goodput']:.3f} req/s under {summary['goodput_slos_ms']} ms")
    rate = summary["prefix_cache_hit_rate"]
    lines.append(f"prefix-cache hit rate: {'n/a' if rate is None else f'{rate:.1%}'}")
    lines.append(f"{'ms':<8}" + "".join(f"{name:>10}" for name in PERCENTILES))
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        dist = summary[metric]
        cells = "".join(f"{dist[name]:>10.1f}" for name in PERCENTILES) if dist else "   (none)"
        lines.append(f"{metric[:-3]:<8}" + cells)
    for turn, dist in summary.get("ttft_ms_by_turn", {}).items():
        prompt = summary["prompt_tokens_by_turn"][turn]
        lines.append(f"turn {turn}: prompt {prompt:.0f} tokens, TTFT mean {dist['mean']:.1f} ms, "
                     f"median {dist['median']:.1f} ms")
    return "\n".join(lines)
