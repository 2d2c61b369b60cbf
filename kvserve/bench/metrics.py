"""From what the client saw of each request to the figures a serving benchmark reports: TTFT, TPOT, ITL, E2E
percentiles, throughput, goodput under SLOs, failures, and the server's prefix-cache hit rate.

Everything here is a pure function of recorded timestamps and counts, so the figures can be checked exactly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import math

import numpy as np

# name -> numpy percentile (None: the mean)
PERCENTILES: dict[str, float | None] = {"mean": None, "median": 50, "p90": 90, "p99": 99, "max": 100}
SLO_METRICS = ("ttft", "tpot", "e2e")
# (queries, hits) counters of prompt tokens looked up in / found in the prefix cache, per server family
PREFIX_CACHE_COUNTERS = (
    ("kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds on one monotonic clock.

    A request succeeded when it has no ``error`` and its stream ended (``end`` is set).
    """

    expected_output_len: int
    start: float = 0.0  # when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # when each chunk carrying tokens arrived
    end: float | None = None  # when the stream ended with [DONE]
    prompt_tokens: int = 0  # the server's count; without usage, the length the workload generated
    completion_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server says
    counted_from_usage: bool = False  # until a usage arrives; without one, the output text is re-tokenized
    error: str | None = None
    group: int | None = None
    turn: int | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive chunks that carried tokens."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:100"]`` -> SLOs in seconds; names ttft, tpot, e2e, values in ms, finite and > 0
    (no request meets a limit of 0 or less, nor of nan)."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            limit_ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not (math.isfinite(limit_ms) and limit_ms > 0):
            raise ValueError(f"--goodput {item!r}: the limit must be a finite number of milliseconds > 0")
        slos[name] = limit_ms / 1000
    return slos


def distribution_ms(values: Sequence[float]) -> dict[str, float] | None:
    """Mean, median, P90, P99 and max in milliseconds (numpy's linear interpolation); None without values."""
    if not len(values):
        return None
    array = np.asarray(values, dtype=np.float64) * 1000
    return {name: float(array.mean() if q is None else np.percentile(array, q)) for name, q in PERCENTILES.items()}


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Succeeded, and within every SLO: a request of one token has no TPOT, so none to miss; one whose stream
    timed no token has neither TTFT nor TPOT, so it meets no limit on them."""
    measured = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}

    def within(name: str, limit: float) -> bool:
        value = measured[name]
        if value is None:
            return name == "tpot" and record.ttft is not None and record.completion_tokens < 2
        return value <= limit

    return record.ok and all(within(name, limit) for name, limit in slos.items())


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float] | None = None
              ) -> dict[str, Any]:
    """Every figure of one run, from its records and its wall time in seconds (latencies in ms)."""
    done = [r for r in records if r.ok]
    num_input = sum(r.prompt_tokens for r in done)
    num_output = sum(r.completion_tokens for r in done)
    summary: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": dict(Counter(r.error for r in records if not r.ok)),
        "num_without_usage": sum(not r.counted_from_usage for r in done),
        "input_tokens": num_input,
        "output_tokens": num_output,
        "request_throughput": len(done) / duration,
        "input_throughput": num_input / duration,
        "output_throughput": num_output / duration,
        "total_throughput": (num_input + num_output) / duration,
        "ttft_ms": distribution_ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in done if r.e2e is not None]),
        "usage_cached_fraction": _usage_cached_fraction(done),
    }
    if slos:
        summary["goodput_slos_ms"] = {name: limit * 1000 for name, limit in slos.items()}
        summary["goodput"] = sum(meets_slos(r, slos) for r in records) / duration
    summary.update(_by_turn(done))
    return summary


def _usage_cached_fraction(done: list[RequestRecord]) -> float | None:
    """Cached prompt tokens over prompt tokens, from the server's usage; None if a request lacks it."""
    num_prompt = sum(r.prompt_tokens for r in done)
    if not num_prompt or any(r.cached_tokens is None for r in done):
        return None
    return sum(r.cached_tokens or 0 for r in done) / num_prompt


def _by_turn(done: list[RequestRecord]) -> dict[str, Any]:
    """Multiturn: TTFT and prompt length per turn index, so later turns over a long history can be read off."""
    turns = sorted({r.turn for r in done if r.turn is not None})
    if not turns:
        return {}
    return {
        "ttft_ms_by_turn": {str(t): distribution_ms([r.ttft for r in done if r.turn == t and r.ttft is not None])
                            for t in turns},
        "prompt_tokens_by_turn": {str(t): float(np.mean([r.prompt_tokens for r in done if r.turn == t]))
                                  for t in turns},
    }


def record_dict(record: RequestRecord) -> dict[str, Any]:
    """One request's figures for the result JSON (ms), without its text."""
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 3)

    return {
        "ok": record.ok, "error": record.error, "group": record.group, "turn": record.turn,
        "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
        "cached_tokens": record.cached_tokens, "counted_from_usage": record.counted_from_usage,
        "ttft_ms": ms(record.ttft), "tpot_ms": ms(record.tpot), "e2e_ms": ms(record.e2e),
        "itl_ms": [ms(gap) for gap in record.itl],
    }


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, summed over labels, by name."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{")[0].strip()
        try:
            samples[name] = samples.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return samples


def server_hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Prompt tokens found in the server's prefix cache over those looked up, between two scrapes of /metrics;
    None when the server exposes no such counters (llama.cpp) or looked nothing up."""
    for queries, hits in PREFIX_CACHE_COUNTERS:
        if queries in after and hits in after:
            num_queries = after[queries] - before.get(queries, 0.0)
            return (after[hits] - before.get(hits, 0.0)) / num_queries if num_queries > 0 else None
    return None
