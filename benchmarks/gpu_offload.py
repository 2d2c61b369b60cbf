"""Weight offload on a CUDA GPU (``--cpu-offload-gb``, issue 22): offline throughput at a published shape with
dummy weights and part of its decoder layers streamed from pinned host memory, against the PCIe bound measured
in the same process (and, run again with ``--offload-gib 0``, against every weight resident).

    python benchmarks/gpu_offload.py [--shape llama3-8b] [--offload-gib 8] [--free-gib 24] [--batch 64] [--json F]

kvserve keeps weights resident when they fit in half the free device memory, so on a large GPU the script first
holds all but ``--free-gib`` of it (a smaller card, as far as the engine can tell). Each run generates
``--batch`` requests of ``--prompt-len`` random tokens and ``--output-len`` new ones, all in one batch (the
prompts are one prefill step): ``--output-len`` steps, each of which streams the offloaded layers once, so
output tokens per second are bounded by ``batch * H2D bandwidth / offloaded bytes``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.checkpoint import SHAPES, make_config_only
from kvserve.model.offload import layer_bytes


def host_to_device_bandwidth(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Bytes per second of a pinned host-to-device copy, the median of 5 after a warm-up."""
    host = torch.empty(num_bytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    seconds = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return num_bytes / statistics.median(seconds[1:])


def run(model: Path, args: argparse.Namespace) -> dict:
    llm = LLM(str(model), load_format="dummy", device="cuda", dtype="bfloat16", cpu_offload_gb=args.offload_gib,
              max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len,
              max_model_len=args.prompt_len + args.output_len + 16)
    model_on_device = llm.engine.core.runner.model
    streamer = model_on_device.weight_streamer
    offloaded = streamer.num_offloaded * layer_bytes(model_on_device.layers[0]) if streamer is not None else 0
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 1000, (args.prompt_len,), generator=generator).tolist()}
               for _ in range(args.batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0),
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"offload_gib_asked": args.offload_gib, "offloaded_bytes": offloaded,
            "offloaded_layers": streamer.num_offloaded if streamer is not None else 0,
            "weights_bytes": llm.stats()["weights_bytes"], "output_tokens": tokens, "seconds": seconds,
            "output_tokens_per_s": tokens / seconds}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", choices=tuple(SHAPES))
    parser.add_argument("--offload-gib", type=float, default=8.0)
    parser.add_argument("--free-gib", type=float, default=24.0, help="device memory left free for the engine")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    device = torch.device("cuda")
    bandwidth = host_to_device_bandwidth(device)
    free, _ = torch.cuda.mem_get_info(device)
    held = torch.empty(max(0, free - int(args.free_gib * 2**30)), dtype=torch.uint8, device=device)
    model = make_config_only(Path(tempfile.mkdtemp()) / args.shape, args.shape)
    print(f"{torch.cuda.get_device_name(device)}: pinned host-to-device {bandwidth / 1e9:.1f} GB/s; "
          f"{held.numel() / 2**30:.1f} GiB held, {torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB free", flush=True)
    report = {"shape": args.shape, "device": torch.cuda.get_device_name(device), "h2d_bytes_per_s": bandwidth,
              "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_len, **run(model, args)}
    bound = ""
    if report["offloaded_bytes"]:  # every step streams the offloaded layers once: the output rate cannot pass this
        report["pcie_bound_tokens_per_s"] = args.batch * bandwidth / report["offloaded_bytes"]
        report["share_of_pcie_bound"] = report["output_tokens_per_s"] / report["pcie_bound_tokens_per_s"]
        bound = f", PCIe bound {report['pcie_bound_tokens_per_s']:.0f} tok/s ({report['share_of_pcie_bound']:.0%})"
    print(f"{report['offloaded_layers']} layers ({report['offloaded_bytes'] / 2**30:.2f} GiB) streamed: "
          f"{report['output_tokens_per_s']:.0f} output tok/s at batch {args.batch}{bound}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
