"""Offline throughput on a CUDA GPU through `kvserve bench`: SmolLM2-135M's shape with dummy bf16 weights (a GPU
machine here cannot download the real GGUF; with exact output lengths, speed does not depend on the weights'
values), kvserve beside transformers' static batches, and the GPU roofline.

    python benchmarks/gpu_throughput.py OUT_DIR [extra `kvserve bench throughput` flags]

writes OUT_DIR/roofline.json and OUT_DIR/throughput.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from kvserve.cli import main as kvserve
from kvserve.model.checkpoint import make_config_only

WORKLOAD = ["--dataset-name", "random", "--num-prompts", "256", "--random-input-len", "272",
            "--random-output-len", "136", "--random-range-ratio", "0.88"]


def run(out: Path, extra: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    model = str(make_config_only(Path(tempfile.mkdtemp()) / "smollm2-135m", "smollm2-135m"))
    status = kvserve(["bench", "roofline", model, "--device", "cuda", "--result-json", str(out / "roofline.json")])
    return status or kvserve([
        "bench", "throughput", model, "--device", "cuda", "--dtype", "bfloat16", "--load-format", "dummy",
        "--backend", "kvserve,hf", "--hf-mode", "static", "--hf-batch-size", "32", "--max-num-batched-tokens", "4096",
        "--max-num-seqs", "256", *WORKLOAD, "--result-json", str(out / "throughput.json"), *extra,
    ])


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):  # not an OUT_DIR (``--help`` made a folder of that name)
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    sys.exit(run(Path(sys.argv[1]), sys.argv[2:]))
