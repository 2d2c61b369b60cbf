"""Run a workload offline through OpenVINO GenAI's ContinuousBatchingPipeline and write a result JSON.

The workload is a JSON file written by ``dump_workload.py``: ``{"workload": {...}, "requests": [{"prompt_token_ids":
[...], "output_len": N}, ...]}``. Every request is submitted at once and generated greedily to exactly
``output_len`` tokens (EOS ignored, ``min_new_tokens == max_new_tokens``); each output length is checked. The
pipeline is warmed up first, then ``time.perf_counter`` is read around the one ``generate`` call that runs the
whole batch; loading and compiling the model are not timed.

This script runs in the OpenVINO virtual environment (/work/peers/ov-venv), which has no kvserve::

    /work/peers/ov-venv/bin/python benchmarks/peers/openvino_genai_offline.py \\
        --model /work/peers/smollm2-ov-fp32 --workload W.json --result-json R.json

Precision: on a CPU with AVX-512 BF16 the plugin computes in bf16 unless told otherwise, and keeps the KV cache in
2-byte elements (bf16, or f16 when computing in f32). kvserve computes and stores KV in fp32, so
``--inference-precision`` defaults to f32; ``--kv-cache-precision default`` keeps the plugin's KV choice and
``f32`` makes the KV cache fp32 as kvserve's is.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

DEVICE = "CPU"
PRECISIONS = ("default", "f32", "bf16", "f16", "u8")
WARMUP_PROMPT_LENS = (16, 300)  # a short prompt and one longer than a 256-token step, so chunked prefill runs
WARMUP_OUTPUT_LEN = 4


def load_workload(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    data = json.loads(path.read_text())
    requests = data["requests"]
    for i, request in enumerate(requests):
        if not request["prompt_token_ids"] or request["output_len"] < 1:
            raise ValueError(f"{path}: request {i} needs a non-empty prompt and output_len >= 1")
    return data.get("workload", {}), requests


def warmup_requests(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prompts of one repeated token: no real prompt starts that way, so prefix caching cannot reuse them."""
    token_id = requests[0]["prompt_token_ids"][-1]
    return [{"prompt_token_ids": [token_id] * n, "output_len": WARMUP_OUTPUT_LEN} for n in WARMUP_PROMPT_LENS]


def plugin_properties(args: argparse.Namespace) -> dict[str, Any]:
    properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": args.num_threads}
    if args.inference_precision != "default":
        properties["INFERENCE_PRECISION_HINT"] = args.inference_precision
    if args.kv_cache_precision != "default":
        properties["KV_CACHE_PRECISION"] = args.kv_cache_precision
    return properties


def scheduler_config(args: argparse.Namespace) -> ov_genai.SchedulerConfig:
    config = ov_genai.SchedulerConfig()
    config.max_num_batched_tokens = args.max_num_batched_tokens
    config.dynamic_split_fuse = True
    config.enable_prefix_caching = args.enable_prefix_caching
    config.cache_size = args.cache_size  # GB; 0 lets the pipeline grow the cache as requests need it
    return config


def greedy_exact(output_len: int) -> ov_genai.GenerationConfig:
    config = ov_genai.GenerationConfig()
    config.do_sample = False
    config.ignore_eos = True
    config.max_new_tokens = output_len
    config.min_new_tokens = output_len
    return config


def generate(pipe: ov_genai.ContinuousBatchingPipeline, requests: list[dict[str, Any]]) -> float:
    """Submit every request at once, check each output length, and return the wall time of the batch."""
    inputs = [ov.Tensor(np.array([r["prompt_token_ids"]], dtype=np.int64)) for r in requests]
    configs = [greedy_exact(r["output_len"]) for r in requests]
    start = time.perf_counter()
    results = pipe.generate(inputs, configs)
    wall_s = time.perf_counter() - start
    for i, (request, result) in enumerate(zip(requests, results)):
        num_generated = len(result.m_generation_ids[0])
        if num_generated != request["output_len"]:
            raise RuntimeError(f"request {i}: generated {num_generated} tokens, asked for {request['output_len']}")
    return wall_s


def pipeline_metrics(pipe: ov_genai.ContinuousBatchingPipeline) -> dict[str, Any]:
    metrics = pipe.get_metrics()
    names = ("requests", "scheduled_requests", "cache_usage", "avg_cache_usage", "max_cache_usage",
             "inference_duration")
    return {name: getattr(metrics, name) for name in names if hasattr(metrics, name)}


def versions() -> dict[str, str]:
    packages = ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "transformers", "torch")
    found = {name: metadata.version(name) for name in packages if _installed(name)}
    cpu = ov.Core().get_property(DEVICE, "FULL_DEVICE_NAME")
    return {**found, "openvino_build": ov.__version__, "python": platform.python_version(), "cpu": cpu}


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def result(args: argparse.Namespace, workload: dict[str, Any], requests: list[dict[str, Any]], wall_s: float,
           pipe: ov_genai.ContinuousBatchingPipeline) -> dict[str, Any]:
    num_input = sum(len(r["prompt_token_ids"]) for r in requests)
    num_output = sum(r["output_len"] for r in requests)
    return {
        "system": "openvino-genai",
        "num_requests": len(requests),
        "num_input_tokens": num_input,
        "num_output_tokens": num_output,
        "wall_s": wall_s,
        "requests_per_s": len(requests) / wall_s,
        "input_tokens_per_s": num_input / wall_s,
        "output_tokens_per_s": num_output / wall_s,
        "total_tokens_per_s": (num_input + num_output) / wall_s,
        "config": {
            "model": str(args.model), "device": DEVICE, "properties": plugin_properties(args),
            "scheduler": scheduler_config(args).to_string(), "enable_prefix_caching": args.enable_prefix_caching,
            "cache_size_gb": args.cache_size, "max_num_batched_tokens": args.max_num_batched_tokens,
            "inference_precision": args.inference_precision, "kv_cache_precision": args.kv_cache_precision,
            "warmup_prompt_lens": list(WARMUP_PROMPT_LENS),
        },
        "pipeline_metrics": pipeline_metrics(pipe),
        "workload": {**workload, "path": str(args.workload)},
        "versions": versions(),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="an OpenVINO IR directory (optimum-cli export)")
    parser.add_argument("--workload", type=Path, required=True, help="a JSON written by dump_workload.py")
    parser.add_argument("--result-json", type=Path, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--cache-size", type=int, default=0, help="KV cache size in GB (0: grow on demand)")
    parser.add_argument("--num-threads", type=int, default=2, help="INFERENCE_NUM_THREADS")
    parser.add_argument("--inference-precision", choices=PRECISIONS, default="f32",
                        help="INFERENCE_PRECISION_HINT (default f32, as kvserve; 'default' keeps the plugin's)")
    parser.add_argument("--kv-cache-precision", choices=PRECISIONS, default="default",
                        help="KV_CACHE_PRECISION ('default' keeps the plugin's: 2-byte elements on this CPU)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    workload, requests = load_workload(args.workload)
    pipe = ov_genai.ContinuousBatchingPipeline(str(args.model), scheduler_config(args), DEVICE,
                                               plugin_properties(args))
    generate(pipe, warmup_requests(requests))
    wall_s = generate(pipe, requests)
    report = result(args, workload, requests, wall_s, pipe)
    args.result_json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"openvino-genai: {report['num_requests']} requests in {wall_s:.2f} s: "
          f"{report['requests_per_s']:.2f} req/s, {report['output_tokens_per_s']:.1f} output tok/s, "
          f"{report['total_tokens_per_s']:.1f} total tok/s -> {args.result_json}")


if __name__ == "__main__":
    main()
