"""Result files of ``kvserve bench``: every figure with the whole configuration, and ``compare``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

# The figures compare puts side by side: (key path, label, higher is better).
COMPARED = [
    (("output_throughput",), "output tok/s", True),
    (("total_throughput",), "total tok/s", True),
    (("request_throughput",), "requests/s", True),
    (("ttft_ms", "median"), "TTFT median ms", False),
    (("ttft_ms", "p99"), "TTFT P99 ms", False),
    (("tpot_ms", "median"), "TPOT median ms", False),
    (("itl_ms", "p99"), "ITL P99 ms", False),
    (("e2e_ms", "median"), "E2E median ms", False),
    (("prefix_cache_hit_rate",), "prefix-cache hit rate", True),
    (("failed",), "failed", False),
]


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "num_cpus": os.cpu_count(), "python": sys.version.split()[0]}


def versions() -> dict[str, str]:
    import torch
    import transformers

    from importlib.metadata import version

    return {"kvserve": version("kvserve"), "torch": torch.__version__, "transformers": transformers.__version__,
            "git_commit": _git_commit()}


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def write_result_json(path: str | Path, result: dict[str, Any], args: argparse.Namespace) -> None:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    document = {**result, "config": config, "machine": machine(), "versions": versions()}
    Path(path).write_text(json.dumps(document, indent=2, default=str) + "\n")


def _get(result: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    value: Any = result
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, (int, float)) else None


def compare_table(paths: list[str]) -> str:
    """Figures of each result side by side; each column after the first with its ratio to the first."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    labels = [r.get("label") or Path(p).stem for r, p in zip(results, paths)]
    width = max(14, *(len(label) for label in labels)) + 2
    lines = [f"{'':<24}" + "".join(f"{label:>{width}}" for label in labels)]
    for keys, name, _ in COMPARED:
        values = [_get(r, keys) for r in results]
        if all(v is None for v in values):
            continue
        cells = []
        for i, value in enumerate(values):
            cell = "-" if value is None else f"{value:.4g}"
            base = values[0]
            if i and value is not None and base:
                cell += f" ({value / base:.2f}x)"
            cells.append(f"{cell:>{width}}")
        lines.append(f"{name:<24}" + "".join(cells))
    return "\n".join(lines)


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="result JSON files; ratios are to the first")


def compare_main(args: argparse.Namespace) -> int:
    print(compare_table(args.results))
    return 0
