"""Offline throughput on a CUDA GPU: kvserve beside transformers ``generate`` (static batches), and the roofline.

The model is SmolLM2-135M's architecture with seeded random weights (a GPU machine here cannot download the
real GGUF; with EOS ignored and exact output lengths, speed does not depend on the weights' values). The
workload is offline_throughput.py's, with more requests. The roofline: measured device-to-device copy
bandwidth and bf16 GEMM rate; decode at batch 1 is bounded by reading the weights once per token, a large
batch by FLOPs.

    python benchmarks/gpu_throughput.py --num-requests 256 --json gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from compute_bound import ModelDims, workload_flops
from offline_throughput import hf_batches, hf_generate, kvserve_generate, lengths, make_workload, token_counts
from kvserve import LLM
from kvserve.model.checkpoint import make_checkpoint

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, max_position_embeddings=8192, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)


def smollm2_shaped_checkpoint(out_dir: Path, seed: int) -> Path:
    """A tiny checkpoint's tokenizer files with SmolLM2-135M's config and seeded random bf16 weights."""
    path = make_checkpoint(out_dir, "llama", "tiny", seed)
    config = transformers.LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def measure_roofline(device: torch.device) -> dict[str, float]:
    x = torch.empty(2**28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    rates = {}
    for name, run, work in (("copy_GBps", lambda: y.copy_(x), 2 * x.numel()),
                            ("bf16_TFLOPs", lambda: a @ a, 2 * 8192**3)):
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            run()
        torch.cuda.synchronize()
        rates[name] = work * 10 / (time.perf_counter() - start) / (1e9 if "GB" in name else 1e12)
    return rates


def timed(run, *args) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = torch.device("cuda")
    path = smollm2_shaped_checkpoint(Path(tempfile.mkdtemp()), args.seed)
    token_ids = list(range(10, 500))
    workload = make_workload(args.num_requests, args.seed, (32, 512), (16, 256), token_ids)
    num_prompt, num_output = token_counts(workload)
    dims = ModelDims.from_hf_config(transformers.AutoConfig.from_pretrained(path))
    roofline = measure_roofline(device)
    weight_bytes = 2 * 134.5e6  # bf16 SmolLM2-135M
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "workload": {"num_requests": args.num_requests, "num_prompt_tokens": num_prompt, "num_output_tokens": num_output},
        "roofline": roofline,
        "bound_decode_batch1_tok_s": roofline["copy_GBps"] * 1e9 / weight_bytes,
        "bound_workload_s": workload_flops(dims, lengths(workload)) / (roofline["bf16_TFLOPs"] * 1e12),
    }
    llm = LLM(str(path), dtype="bfloat16", device="cuda", max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs)
    kvserve_generate(llm, workload[:4])
    systems = {"kvserve": timed(kvserve_generate, llm, workload)}
    report["kvserve_stats"] = llm.stats()
    del llm
    torch.cuda.empty_cache()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    hf_generate(hf, workload[:2], 0)
    systems[f"hf-static{args.hf_batch_size}"] = timed(
        lambda w: [hf_generate(hf, b, 0) for b in hf_batches(w, args.hf_batch_size)], workload
    )
    one = workload[: max(4, args.num_requests // 32)]
    systems["hf-single (subset)"] = timed(lambda w: [hf_generate(hf, [r], 0) for r in w], one)
    report["systems"] = {}
    for name, wall in systems.items():
        n_prompt, n_out = token_counts(one) if "subset" in name else (num_prompt, num_output)
        report["systems"][name] = {"wall_s": wall, "output_tok_s": n_out / wall, "total_tok_s": (n_prompt + n_out) / wall}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
