"""Offline throughput on a CUDA GPU through `kvserve bench`: SmolLM2-135M's architecture with seeded random bf16
weights (a GPU machine here cannot download the real GGUF; with exact output lengths, speed does not depend on
the weights' values), kvserve beside transformers' static batches, and the GPU roofline.

    python benchmarks/gpu_throughput.py OUT_DIR [extra `kvserve bench throughput` flags]

writes OUT_DIR/roofline.json and OUT_DIR/throughput.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

from kvserve.cli import main as kvserve
from kvserve.model.checkpoint import make_checkpoint

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, max_position_embeddings=8192, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
WORKLOAD = ["--dataset-name", "random", "--num-prompts", "256", "--random-input-len", "272",
            "--random-output-len", "136", "--random-range-ratio", "0.88"]


def smollm2_shaped_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """A tiny checkpoint's tokenizer files with SmolLM2-135M's config and seeded random bf16 weights."""
    path = make_checkpoint(out_dir, "llama", "tiny", seed)
    config = transformers.LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def run(out: Path, extra: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    model = str(smollm2_shaped_checkpoint(Path(tempfile.mkdtemp())))
    status = kvserve(["bench", "roofline", model, "--device", "cuda", "--result-json", str(out / "roofline.json")])
    return status or kvserve([
        "bench", "throughput", model, "--device", "cuda", "--dtype", "bfloat16", "--backend", "kvserve,hf",
        "--hf-mode", "static", "--hf-batch-size", "32", "--max-num-batched-tokens", "4096", "--max-num-seqs", "256",
        *WORKLOAD, "--result-json", str(out / "throughput.json"), *extra,
    ])


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]), sys.argv[2:]))
