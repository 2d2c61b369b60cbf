"""The headline figures of a `gpu_run.sh` results folder, one line each, for the end of a device call's output
(the tool returns only the output's tail, and a lease has no time to unpack and read every file).

    python benchmarks/gpu_summary.py RESULTS_DIR

Reads what the steps write: pytest's closing lines and uncaught exceptions in `*.log`, `gpu_decode_step.py`'s step tables, `kvserve bench
throughput`, `serve` and `roofline` result files, and `structured_output.py`'s JSON lines.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from kvserve.bench.step_trace import format_step_trace

UNCAUGHT = re.compile(r"^[A-Za-z_.]*(Error|Exception|Interrupt|Exit): ")  # a traceback's last line
PYTEST_TOTALS = re.compile(r"^=*\s*(\d+ \w+(?:, \d+ \w+)* in [\d.]+s.*?)\s*=*$")  # "2 failed, 258 passed in 154.44s"


def log_lines(log: Path) -> Iterator[str]:
    """pytest's totals and failures, an uncaught exception's last line, a step stopped at the deadline, and
    ``triton_attention.py``'s cascade lines."""
    for line in log.read_text(errors="replace").splitlines():
        match = PYTEST_TOTALS.match(line.strip())
        if match:
            yield f"pytest: {match.group(1)}"
        elif line.startswith(("FAILED ", "ERROR ", "STOPPED: ", "cascade: ")) or UNCAUGHT.match(line):
            yield line[:200]


def decode_lines(result: dict[str, Any]) -> Iterator[str]:
    mode = "eager" if result.get("enforce_eager") else "graphs"
    if result.get("weights_format", result["dtype"]) != result["dtype"]:
        mode = f"{result['weights_format']}, {mode}"
    if result.get("kv_cache_dtype", result["dtype"]) != result["dtype"]:
        mode = f"KV {result['kv_cache_dtype']}, {mode}"
    if result.get("min_split_keys"):
        mode += f", splits of >= {result['min_split_keys']} keys"
    mode += ", separate merge" if result.get("separate_merge") else ""
    mode += ", torch GEMMs" if result.get("torch_gemms") else ""
    mode += ", no PDL" if result.get("pdl") is False else ""
    choices = result.get("kernel_choices") or {}
    for name in ("skinny", "dequantized GEMM"):
        made = [took for key, took in choices.items() if key.startswith(f"{name} (")]
        mode += f", {name} in {sum(made)} of {len(made)} classes" if made else ""
    for row in result["rows"]:
        runner = f" (runner {row['runner_median_ms']:.2f})" if "runner_median_ms" in row else ""
        yield (f"{result['shape']} {result['dtype']} {mode}, batch {row['batch']}: step {row['median_ms']:.2f} ms"
               f"{runner}, {row['tokens_per_s']:,.0f} tok/s, "
               f"{row['fraction_of_roofline']:.0%} of the {row['roofline_ms']:.2f} ms weight-read roofline")


def throughput_lines(result: dict[str, Any]) -> Iterator[str]:
    for name, system in result["systems"].items():
        stats = system.get("details", {}).get("stats", {})
        preempted = f", {stats['num_preemptions']} preemptions" if "num_preemptions" in stats else ""
        if "num_graph_replays" in stats:
            preempted += f", {stats['num_graph_replays']} steps through CUDA graphs"
        yield (f"{result['label']} {name}: {system['output_throughput']:,.0f} output tok/s, {system['completed']} "
               f"requests in {system['duration_s']:.0f} s{preempted}")
        if "step_trace" in system.get("details", {}):
            yield f"{result['label']} {name} {format_step_trace(system['details']['step_trace'])}"
    for name, ratios in result["ratios"].items():
        others = ", ".join(f"{ratio:.2f}x {other}" for other, ratio in ratios.items() if other != name)
        if others and name == "kvserve":
            yield f"{result['label']} kvserve: {others}"


def serve_lines(result: dict[str, Any]) -> Iterator[str]:
    for run in result["runs"]:
        yield (f"{result['label']} rate {run['request_rate']}: {run['output_throughput']:,.0f} output tok/s, "
               f"{run['completed']} done / {run['failed']} failed, TTFT P99 {run['ttft_ms']['p99']:,.0f} ms, "
               f"TPOT P99 {run['tpot_ms']['p99']:.1f} ms, ITL P99 {run['itl_ms']['p99']:.1f} ms")


def roofline_lines(result: dict[str, Any]) -> Iterator[str]:
    yield f"roofline on {result['device']}: copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s"
    for dtype, bounds in result["bounds"].items():
        yield f"roofline {dtype}: batch-1 decode bound {bounds['decode_batch1_tokens_per_s']:,.0f} tok/s"


def json_lines(result: dict[str, Any]) -> Iterator[str]:
    if "rows" in result:
        yield from decode_lines(result)
    elif result.get("kind") == "throughput":
        yield from throughput_lines(result)
    elif result.get("kind") == "serve":
        yield from serve_lines(result)
    elif result.get("kind") == "roofline":
        yield from roofline_lines(result)
    elif "later_turn_ttft_median_s" in result.get("recompute", {}):
        for name in ("host", "disk", "device"):
            yield (f"multiturn {name}: later turns' TTFT {result[name]['later_turn_ttft_median_s'] * 1e3:.1f} ms, "
                   f"{result[name]['speedup_vs_recompute']:.2f}x lower than recomputing "
                   f"({result['recompute']['later_turn_ttft_median_s'] * 1e3:.1f} ms)")
        yield f"multiturn: first tokens agree across the variants: {result.get('first_tokens_agree', True)}"
    elif "ttft_from_disk_s" in result:
        disk_ms = result["ttft_from_disk_s"] * 1e3
        yield (f"restart: a {result['prefix_len']}-token prefix from the disk tier {disk_ms:.1f} ms, "
               f"{result['speedup']:.1f}x sooner than a cold prefill ({result['ttft_cold_s'] * 1e3:.1f} ms), "
               f"{result['cached_tokens']} tokens cached, text identical: {result['identical_text']}")
    elif "h2d_bytes_per_s" in result:
        bound = (f", {result['share_of_pcie_bound']:.0%} of the PCIe bound {result['pcie_bound_tokens_per_s']:,.0f}"
                 if result["offloaded_bytes"] else "")
        yield (f"offload {result['shape']}: {result['offloaded_bytes'] / 2**30:.2f} GiB streamed, "
               f"{result['output_tokens_per_s']:,.0f} output tok/s at batch {result['batch']}{bound} "
               f"(host-to-device {result['h2d_bytes_per_s'] / 1e9:.1f} GB/s)")
    elif "json_tok_s" in result:
        yield (f"structured {result['streams']} streams / {result['schemas']} schemas: {result['ratio']:.2f}x free "
               f"({result['json_tok_s']:,.0f} against {result['free_tok_s']:,.0f} tok/s), "
               f"{result['steps_scheduled_ahead']} steps scheduled ahead")


def file_lines(path: Path) -> Iterator[str]:
    if path.suffix == ".log":
        yield from log_lines(path)
        return
    text = path.read_text(errors="replace")
    try:
        results = [json.loads(text)]
    except json.JSONDecodeError:  # JSON lines (structured_output.py), or a file cut short by a timeout
        try:
            results = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            yield f"unreadable: {exc}"
            return
    for result in results:
        try:
            yield from json_lines(result)
        except (KeyError, TypeError, ValueError) as exc:
            yield f"unexpected layout: {exc!r}"


def summarize(results: Path) -> list[str]:
    lines = []
    for path in sorted(p for p in results.rglob("*") if p.suffix in (".json", ".log")):
        lines.extend(f"{path.relative_to(results)}: {line}" for line in file_lines(path))
    return lines


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit(__doc__)
    print("\n".join(summarize(Path(sys.argv[1]))))
