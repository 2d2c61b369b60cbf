"""What LoRA adapters cost a batch: offline greedy output tok/s of ``--requests`` streams over one engine with
``--enable-lora``, the requests spread round-robin over 0 (the base model), 1, 2 or 4 seeded random adapters
(``make_lora_adapter``, rank ``--rank`` on every projection of every layer), taking turns in each round.

    python benchmarks/lora_throughput.py --model smollm2-135m-instruct --rounds 3

The base model's weights are the model's as kvserve loads them (the default model's shipped GGUF blocks, or fp32
with ``--quantization none``); an adapter's terms are two skinny GEMMs per projection and adapter of the step
(``model/layers/lora.py``), in plain PyTorch. Fixed lengths (``ignore_eos``); wall-clock seconds on this CPU.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.bench.report import machine
from kvserve.model.lora_checkpoint import make_lora_adapter


def adapters(model: str, count: int, rank: int, root: Path) -> list[LoRARequest]:
    """``count`` seeded adapters for ``model``."""
    return [LoRARequest(f"adapter{i}", i + 1, str(make_lora_adapter(model, root / f"adapter{i}", rank=rank, seed=i)))
            for i in range(count)]


def tokens_per_second(llm: LLM, prompts: list[dict], params: SamplingParams, loras: list[LoRARequest]) -> float:
    per_prompt = [loras[i % len(loras)] if loras else None for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
    return sum(len(out.outputs[0].token_ids) for out in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--counts", default="0,1,2,4", help="adapters the requests spread over, each a turn")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    llm = LLM(args.model, quantization=args.quantization, enable_lora=True, max_loras=max(max(counts), 1),
              max_lora_rank=args.rank, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 100 for j in range(args.prompt_len)]}
               for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as root:
        made = adapters(args.model, max(counts), args.rank, Path(root))
        tokens_per_second(llm, prompts[:2], params, made)  # every adapter loaded, the first steps warmed
        results: dict[int, list[float]] = {count: [] for count in counts}
        for _ in range(args.rounds):
            for count in counts:
                results[count].append(tokens_per_second(llm, prompts, params, made[:count]))
    print(f"# {machine()}; {args.model} ({args.quantization}), {args.requests} streams x {args.output_len} tokens, "
          f"prompts of {args.prompt_len}, adapters of rank {args.rank}, {args.rounds} rounds taking turns")
    base = statistics.median(results[0]) if 0 in results else None
    for count, figures in results.items():
        median = statistics.median(figures)
        ratio = f"  {median / base:.2f}x the base model's" if base else ""
        print(f"adapters {count}: {median:8.1f} tok/s (rounds: {', '.join(f'{f:.1f}' for f in figures)}){ratio}")


if __name__ == "__main__":
    main()
