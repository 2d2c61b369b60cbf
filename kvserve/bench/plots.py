"""PNGs of ``kvserve bench serve`` runs: the TTFT, TPOT and E2E latency distributions (one line per run), and for
a sweep over request rates, throughput and P99 latency against rate.

Figures are drawn on matplotlib's Agg canvas directly, so no display and no global pyplot state are involved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

DISTRIBUTIONS = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "E2E latency"}


def write_plots(runs: list[dict[str, Any]], out_dir: str | Path, title: str) -> list[Path]:
    """Write the PNGs of ``runs`` (the runs of one result, with their per-request figures) into ``out_dir``;
    returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [_distribution(runs, metric, name, out / f"{metric.removesuffix('_ms')}.png", title)
             for metric, name in DISTRIBUTIONS.items()]
    if len(runs) > 1:
        paths += [_throughput_vs_rate(runs, out / "throughput_vs_rate.png", title),
                  _p99_vs_rate(runs, out / "p99_latency_vs_rate.png", title)]
    return paths


def _distribution(runs: list[dict[str, Any]], metric: str, name: str, path: Path, title: str) -> Path:
    """Empirical CDF of one latency over the requests that completed, one line per run."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for run in runs:
        values = np.sort([r[metric] for r in run["requests"] if r["ok"] and r[metric] is not None])
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                    label=f"rate {run['request_rate']}")
    ax.set(xlabel=f"{name} (ms)", ylabel="fraction of requests", title=f"{name}: {title}", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def _rate_axis(ax: Any, runs: list[dict[str, Any]]) -> range:
    """Rates as evenly spaced categories, since inf has no place on a numeric axis."""
    positions = range(len(runs))
    ax.set_xticks(list(positions), [str(run["request_rate"]) for run in runs])
    ax.set_xlabel("request rate (req/s)")
    ax.grid(alpha=0.3)
    return positions


def _throughput_vs_rate(runs: list[dict[str, Any]], path: Path, title: str) -> Path:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    x = _rate_axis(ax, runs)
    ax.plot(x, [run["output_throughput"] for run in runs], marker="o", label="output tok/s")
    ax.plot(x, [run["total_throughput"] for run in runs], marker="s", label="total tok/s")
    ax.set(ylabel="tokens/s", title=f"throughput: {title}")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def _p99_vs_rate(runs: list[dict[str, Any]], path: Path, title: str) -> Path:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    x = _rate_axis(ax, runs)
    for metric, name in DISTRIBUTIONS.items():
        ax.plot(x, [run[metric]["p99"] if run[metric] else np.nan for run in runs], marker="o", label=f"{name} P99")
    ax.set(ylabel="ms", yscale="log", title=f"P99 latency: {title}")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
