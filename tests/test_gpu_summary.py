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
    (tmp_path / "weight_only.log").write_text("Traceback (most recent call last):\n  File x\n"
                                              "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate\n"
                                              "STOPPED: weight_only at the 540 s deadline\n")
    (tmp_path / "kernels.log").write_text(
        "Llama-3-8B    decode x64 @2048           1.584      0.238      6.7x         2252\n"
        "cascade: Llama-3-8B, 64 decodes at 2,048 keys, 1,984 shared: triton 0.041 ms against 0.238 ms sharing "
        "nothing (5.8x)\n")
    (tmp_path / "tests.log").write_text(
        "....F\nFAILED tests/engine/test_cuda.py::test_x - AssertionError: boom\n"
        "========= 1 failed, 258 passed, 1 skipped in 154.44s (0:02:34) =========\n")
    step = {"batch": 1, "median_ms": 5.01, "runner_median_ms": 4.91, "tokens_per_s": 199.6, "roofline_ms": 3.84,
            "fraction_of_roofline": 0.766}
    (tmp_path / "profile-llama3-8b.json").write_text(json.dumps({
        "shape": "llama3-8b", "dtype": "bfloat16", "enforce_eager": False, "rows": [step],
        "kernel_choices": {"skinny (4096, 4096, -1, torch.bfloat16, 1)": True,
                           "skinny (28672, 4096, -1, torch.bfloat16, 1)": False}}))
    (tmp_path / "gemms-torch.json").write_text(json.dumps({
        "shape": "llama3-8b", "dtype": "bfloat16", "rows": [step], "torch_gemms": True, "kernel_choices": {},
        "min_split_keys": 64, "separate_merge": True, "pdl": False}))
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
    (tmp_path / "kv-decode-int4.json").write_text(json.dumps({
        "shape": "llama3-8b", "dtype": "bfloat16", "weights_format": "int4 weight-only", "kv_cache_dtype": "int8",
        "rows": [{"batch": 64, "median_ms": 20.0, "tokens_per_s": 3200.0, "roofline_ms": 1.0,
                  "fraction_of_roofline": 0.05}]}))
    tier = {"later_turn_ttft_median_s": 0.01, "speedup_vs_recompute": 5.0}
    (tmp_path / "kv-multiturn.json").write_text(json.dumps({
        "recompute": {"later_turn_ttft_median_s": 0.05}, "host": tier, "disk": tier, "device": tier,
        "first_tokens_agree": False}))
    (tmp_path / "kv-restart.json").write_text(json.dumps({
        "prefix_len": 1500, "ttft_from_disk_s": 0.02, "ttft_cold_s": 0.2, "speedup": 10.0, "cached_tokens": 1488,
        "identical_text": True}))
    (tmp_path / "offload-8.json").write_text(json.dumps({
        "shape": "llama3-8b", "h2d_bytes_per_s": 50e9, "batch": 64, "offloaded_bytes": 8 * 2**30,
        "output_tokens_per_s": 300.0, "pcie_bound_tokens_per_s": 372.5, "share_of_pcie_bound": 0.805}))
    lines = summarize(tmp_path)
    assert lines == [
        "gemms-torch.json: llama3-8b bfloat16 graphs, splits of >= 64 keys, separate merge, torch GEMMs, no PDL, "
        "batch 1: "
        "step 5.01 ms (runner 4.91), 200 tok/s, 77% of the 3.84 ms weight-read roofline",
        "kernels.log: cascade: Llama-3-8B, 64 decodes at 2,048 keys, 1,984 shared: triton 0.041 ms against 0.238 ms "
        "sharing nothing (5.8x)",
        "kv-decode-int4.json: llama3-8b bfloat16 KV int8, int4 weight-only, graphs, batch 64: step 20.00 ms, 3,200 "
        "tok/s, 5% of the 1.00 ms weight-read roofline",
        *[f"kv-multiturn.json: multiturn {name}: later turns' TTFT 10.0 ms, 5.00x lower than recomputing (50.0 ms)"
          for name in ("host", "disk", "device")],
        "kv-multiturn.json: multiturn: first tokens agree across the variants: False",
        "kv-restart.json: restart: a 1500-token prefix from the disk tier 20.0 ms, 10.0x sooner than a cold prefill "
        "(200.0 ms), 1488 tokens cached, text identical: True",
        "offload-8.json: offload llama3-8b: 8.00 GiB streamed, 300 output tok/s at batch 64, 80% of the PCIe bound "
        "372 (host-to-device 50.0 GB/s)",
        "profile-llama3-8b.json: llama3-8b bfloat16 graphs, skinny in 1 of 2 classes, batch 1: step 5.01 ms "
        "(runner 4.91), 200 tok/s, 77% of the 3.84 ms weight-read roofline",
        "random.json: random kvserve: 3,990 output tok/s, 128 requests in 8 s, 0 preemptions",
        "random.json: random hf-static32: 502 output tok/s, 128 requests in 65 s",
        "random.json: random kvserve: 7.94x hf-static32",
        "structured.json: structured 64 streams / 8 schemas: 0.90x free (8,100 against 9,000 tok/s), 310 steps "
        "scheduled ahead",
        "sweep.json: llama3-8b rate inf: 3,661 output tok/s, 128 done / 0 failed, TTFT P99 3,617 ms, TPOT P99 25.9 "
        "ms, ITL P99 30.1 ms",
        "tests.log: FAILED tests/engine/test_cuda.py::test_x - AssertionError: boom",
        "tests.log: pytest: 1 failed, 258 passed, 1 skipped in 154.44s (0:02:34)",
        "weight_only.log: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate",
        "weight_only.log: STOPPED: weight_only at the 540 s deadline",
    ]


def test_a_file_cut_short_or_of_another_layout_is_named_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "fixed.json").write_text('{"kind": "throughput", "label": "fix')  # a step stopped mid-write
    (tmp_path / "decode.json").write_text(json.dumps({"shape": "x", "dtype": "bfloat16", "rows": [{"batch": 1}]}))
    lines = summarize(tmp_path)
    assert len(lines) == 2
    assert lines[0].startswith("decode.json: unexpected layout: KeyError(")
    assert lines[1].startswith("fixed.json: unreadable: ")
