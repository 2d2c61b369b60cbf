"""benchmarks/gpu_summary.py: a line for each headline figure of a results folder, from every kind of file
`gpu_run.sh`'s steps write, and a line that says so for a file it cannot read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_summary.py"


def summarize(folder: Path) -> list[str]:
    result = subprocess.run([sys.executable, str(SCRIPT), str(folder)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_every_kind_of_result_gets_its_figures(tmp_path: Path) -> None:
    (tmp_path / "tests.log").write_text(
        "....F\nFAILED tests/engine/test_cuda.py::test_x - AssertionError: boom\n"
        "========= 1 failed, 258 passed, 1 skipped in 154.44s (0:02:34) =========\n")
    (tmp_path / "profile-llama3-8b.json").write_text(json.dumps({
        "shape": "llama3-8b", "dtype": "bfloat16", "enforce_eager": False, "rows": [
            {"batch": 1, "median_ms": 5.01, "runner_median_ms": 4.91, "tokens_per_s": 199.6, "roofline_ms": 3.84,
             "fraction_of_roofline": 0.766}]}))
    system = {"output_throughput": 3990.4, "completed": 128, "duration_s": 8.2,
              "details": {"stats": {"num_preemptions": 0}}}
    (tmp_path / "random.json").write_text(json.dumps({
        "kind": "throughput", "label": "random",
        "systems": {"kvserve": system, "hf-static32": {"output_throughput": 502.4, "completed": 128, "duration_s": 65}},
        "ratios": {"kvserve": {"kvserve": 1.0, "hf-static32": 7.94}, "hf-static32": {"kvserve": 0.126}}}))
    latency = {"p99": 3616.6}
    (tmp_path / "sweep.json").write_text(json.dumps({"kind": "serve", "label": "llama3-8b", "runs": [
        {"request_rate": "inf", "output_throughput": 3661.2, "completed": 128, "failed": 0, "ttft_ms": latency,
         "tpot_ms": {"p99": 25.9}, "itl_ms": {"p99": 30.1}}]}))
    (tmp_path / "structured.json").write_text(json.dumps(
        {"streams": 64, "schemas": 8, "free_tok_s": 9000.0, "json_tok_s": 8100.0, "ratio": 0.9,
         "steps_scheduled_ahead": 310}) + "\n" + json.dumps({"compile_cold_ms": 12.0}) + "\n")
    lines = summarize(tmp_path)
    assert lines == [
        "profile-llama3-8b.json: llama3-8b bfloat16 graphs, batch 1: step 5.01 ms (runner 4.91), 200 tok/s, 77% of "
        "the 3.84 ms weight-read roofline",
        "random.json: random kvserve: 3,990 output tok/s, 128 requests in 8 s, 0 preemptions",
        "random.json: random hf-static32: 502 output tok/s, 128 requests in 65 s",
        "random.json: random kvserve: 7.94x hf-static32",
        "structured.json: structured 64 streams / 8 schemas: 0.90x free (8,100 against 9,000 tok/s), 310 steps "
        "scheduled ahead",
        "sweep.json: llama3-8b rate inf: 3,661 output tok/s, 128 done / 0 failed, TTFT P99 3,617 ms, TPOT P99 25.9 "
        "ms, ITL P99 30.1 ms",
        "tests.log: FAILED tests/engine/test_cuda.py::test_x - AssertionError: boom",
        "tests.log: pytest: 1 failed, 258 passed, 1 skipped in 154.44s (0:02:34)",
    ]


def test_a_file_cut_short_or_of_another_layout_is_named_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "fixed.json").write_text('{"kind": "throughput", "label": "fix')  # a step stopped mid-write
    (tmp_path / "decode.json").write_text(json.dumps({"shape": "x", "dtype": "bfloat16", "rows": [{"batch": 1}]}))
    lines = summarize(tmp_path)
    assert len(lines) == 2
    assert lines[0].startswith("decode.json: unexpected layout: KeyError(")
    assert lines[1].startswith("fixed.json: unreadable: ")
