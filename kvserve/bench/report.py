"""What ``kvserve bench`` shows and keeps: the table of a run, the table of a sweep, result files with the whole
configuration (machine, model, versions, git commit), and ``compare``, which puts result files side by side.

A result file holds ``{"kind", "label", ...}`` and either its figures at the top level or a list of ``runs``
(one per request rate of ``bench serve``); ``compare`` makes a column of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from kvserve.bench.metrics import PERCENTILES

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
# The rows of compare: (key path, label). Figures no file has are left out.
COMPARED = [
    (("request_throughput",), "requests/s"),
    (("input_throughput",), "input tok/s"),
    (("output_throughput",), "output tok/s"),
    (("total_throughput",), "total tok/s"),
    (("goodput",), "goodput req/s"),
    (("ttft_ms", "median"), "TTFT median ms"),
    (("ttft_ms", "p99"), "TTFT P99 ms"),
    (("tpot_ms", "median"), "TPOT median ms"),
    (("tpot_ms", "p99"), "TPOT P99 ms"),
    (("itl_ms", "p99"), "ITL P99 ms"),
    (("e2e_ms", "median"), "E2E median ms"),
    (("e2e_ms", "p99"), "E2E P99 ms"),
    (("prefix_cache_hit_rate",), "prefix-cache hit rate"),
    (("completed",), "completed"),
    (("failed",), "failed"),
]
VERSIONED_PACKAGES = ("kvserve", "torch", "transformers", "httpx", "numpy")
REDACTED = "<redacted>"


# ---- tables --------------------------------------------------------------------------------------------


def format_run(run: dict[str, Any], title: str) -> str:
    """The table of one ``bench serve`` run."""
    lines = [f"== {title} ==",
             f"completed {run['completed']}, failed {run['failed']}, {run['duration_s']:.2f} s"]
    lines += [f"  error x{count}: {error}" for error, count in run["errors"].items()]
    if run["num_without_usage"]:
        lines.append(f"  {run['num_without_usage']} requests came without usage: their output tokens are their text "
                     "re-tokenized with the benchmark's tokenizer, and their input tokens the workload's lengths")
    lines.append(f"throughput: {run['request_throughput']:.3f} req/s, tokens/s input {run['input_throughput']:.1f}, "
                 f"output {run['output_throughput']:.1f}, total {run['total_throughput']:.1f}")
    if "goodput" in run:
        slos = ", ".join(f"{name} <= {limit:g} ms" for name, limit in run["goodput_slos_ms"].items())
        lines.append(f"goodput: {run['goodput']:.3f} req/s with {slos}")
    lines.append(f"prefix-cache hit rate (server /metrics): {_percent(run['prefix_cache_hit_rate'])}, "
                 f"cached prompt tokens (usage): {_percent(run['usage_cached_fraction'])}")
    lines.append(f"{'ms':<6}" + "".join(f"{name:>10}" for name in PERCENTILES))
    for metric in LATENCIES:
        dist = run[metric]
        cells = "".join(f"{dist[name]:>10.1f}" for name in PERCENTILES) if dist else "    (none)"
        lines.append(f"{metric.removesuffix('_ms'):<6}" + cells)
    for turn, dist in run.get("ttft_ms_by_turn", {}).items():
        lines.append(f"turn {turn}: prompt {run['prompt_tokens_by_turn'][turn]:.0f} tokens, "
                     f"TTFT median {dist['median']:.1f} ms, P99 {dist['p99']:.1f} ms")
    return "\n".join(lines)


def format_sweep(runs: list[dict[str, Any]]) -> str:
    """Throughput and P99 latencies against request rate."""
    lines = [f"{'rate':>6}{'req/s':>9}{'out tok/s':>11}{'TTFT P99':>10}{'TPOT P99':>10}{'E2E P99':>10}{'failed':>8}"]
    for run in runs:
        p99 = [f"{run[m]['p99']:>10.1f}" if run[m] else f"{'-':>10}" for m in ("ttft_ms", "tpot_ms", "e2e_ms")]
        lines.append(f"{run['request_rate']!s:>6}{run['request_throughput']:>9.3f}{run['output_throughput']:>11.1f}"
                     + "".join(p99) + f"{run['failed']:>8}")
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


# ---- result files --------------------------------------------------------------------------------------


def write_result_json(path: str | Path, result: dict[str, Any], args: argparse.Namespace) -> None:
    """``result`` with the command's configuration, the machine, the package versions and the git commit."""
    config = _redacted({key: value for key, value in vars(args).items() if key != "func"})
    document = {**result, "config": config, "machine": machine(), "versions": versions()}
    # default: Paths in the config
    Path(path).write_text(json.dumps(document, indent=1, default=str) + "\n", encoding="utf-8")


def _redacted(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration without the API key, in its field or in the command line: result files are shared."""
    key = config.get("api_key")
    if not key:
        return config
    argv = [arg.replace(key, REDACTED) for arg in config.get("argv", [])]  # "--api-key KEY" and "--api-key=KEY"
    return {**config, "api_key": REDACTED, **({"argv": argv} if "argv" in config else {})}


def check_output_path(path: str | Path, flag: str, directory: bool = False) -> None:
    """Raise ValueError naming ``flag`` if ``path`` cannot take a file (or, with ``directory``, a folder made with
    its parents): checked before a benchmark runs, so that a mistyped path does not throw its results away."""
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        raise ValueError(f"{flag} {path}: exists and is not {'a directory' if directory else 'a file'}")
    nearest = path if path.exists() else next(p for p in path.parents if p.exists())
    if not directory and nearest not in (path, path.parent):  # a file's folder is not made for it
        raise ValueError(f"{flag} {path}: the directory {path.parent} does not exist")
    if nearest != path and not nearest.is_dir():
        raise ValueError(f"{flag} {path}: {nearest} is not a directory")
    if not os.access(nearest, os.W_OK):
        raise ValueError(f"{flag} {path}: {nearest} is not writable")


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "cpu": _cpu_name(), "num_cpus": os.cpu_count(),
                            "memory_gib": _memory_gib(), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def versions() -> dict[str, Any]:
    found = {}
    for package in VERSIONED_PACKAGES:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return {**found, **_git_state()}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None
    return round(kib / 2**20, 1)


def _git_state(package_dir: Path = Path(__file__).resolve().parents[1]) -> dict[str, Any]:
    """The commit of the kvserve checkout and whether it has uncommitted changes: None outside a checkout, and
    for a package installed inside some other repository (a project's own .venv), whose commit is not kvserve's."""
    def git(*command: str) -> str | None:
        try:
            out = subprocess.run(["git", *command], capture_output=True, text=True, timeout=10, cwd=package_dir)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    is_checkout = top is not None and Path(top).resolve() == package_dir.parent
    commit = git("rev-parse", "HEAD") if is_checkout else None
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


# ---- compare -------------------------------------------------------------------------------------------


def compare_table(paths: list[str | Path]) -> str:
    """The figures of every run of every file side by side; each column after the first with its ratio to the
    first. A column is headed by its run's label, and by its file too where another column has the same label
    (two runs without ``--label`` are both "kvserve random"): the file's name, or as much of its path as tells the
    files apart (``before/kvserve-c16``, ``after/kvserve-c16``)."""
    columns = [(Path(path), *column) for path in paths for column in _columns(Path(path))]
    label_counts = Counter(name for _, name, _ in columns)
    repeated = [path for path, name, _ in columns if label_counts[name] > 1]
    names = [f"{name} ({_distinct_name(path, repeated)})" if label_counts[name] > 1 else name
             for path, name, _ in columns]
    columns = [(name, figures) for name, (_, _, figures) in zip(names, columns)]
    rows = []
    for keys, row_name in COMPARED:
        values = [_get(figures, keys) for _, figures in columns]
        if any(value is not None for value in values):
            rows.append((row_name, [_cell(value, values[0] if i else None) for i, value in enumerate(values)]))
    # every column two spaces wider than its widest entry, so that no two cells run together
    width = max(16, *(len(text) + 2 for text in names + [cell for _, cells in rows for cell in cells]))
    lines = [f"{'':<24}" + "".join(f"{name:>{width}}" for name in names)]
    lines += [f"{row_name:<24}" + "".join(f"{cell:>{width}}" for cell in cells) for row_name, cells in rows]
    return "\n".join(lines)


def _distinct_name(path: Path, others: list[Path]) -> str:
    """The shortest tail of ``path`` (without its suffix) that no other of ``others`` ends in."""
    parts = path.with_suffix("").parts
    tails = [other.with_suffix("").parts for other in others if other != path]
    for length in range(1, len(parts) + 1):
        if all(tail[-length:] != parts[-length:] for tail in tails):
            return "/".join(parts[-length:])
    return str(path)


def _columns(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        document = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a result JSON: {e}") from None
    if not isinstance(document, dict) or "kind" not in document:
        raise ValueError(f"{path} is not a kvserve result JSON (no 'kind')")
    label = document.get("label") or path.stem
    runs = document.get("runs", [document])
    if not isinstance(runs, list) or not runs or not all(isinstance(run, dict) for run in runs):
        raise ValueError(f"{path}: 'runs' is not a non-empty list of runs")
    if len(runs) == 1:
        return [(label, runs[0])]
    return [(f"{label} @{run.get('request_rate')}", run) for run in runs]


def _get(figures: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    value: Any = figures
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value if isinstance(value, (int, float)) else None


def _cell(value: float | None, base: float | None) -> str:
    if value is None:
        return "-"
    cell = f"{value:.4g}" if abs(value) < 10_000 else f"{value:.0f}"  # no exponent: 59060, not 5.906e+04
    return f"{cell} ({value / base:.2f}x)" if base else cell


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files; ratios are to the first")


def compare_main(args: argparse.Namespace) -> int:
    print(compare_table(args.results))
    return 0
