"""CPU step graphs against eager steps: one engine of each in the same process, taking turns on the same requests,
so that load from other processes hits both alike.

    PYTHONPATH=. python benchmarks/cpu_step_graph.py [--model smollm2-135m-instruct] [--streams 1,4,16]
        [--rounds 3] [--quantization auto|none] [--quantize-activations] [--kv-cache-dtype auto|int8|fp8|int4]

Each round runs ``streams`` requests at once (256-token random prompts, 128 greedy tokens each, ``ignore_eos``) on
each engine in turn, step by step; every step after the prompts' prefill is a decode step of every request.
Prints the median decode step time per engine (a stream's time per output token) and their ratio.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from kvserve import LLM, SamplingParams

PROMPT_LEN, OUTPUT_LEN = 256, 128


def decode_step_ms(llm: LLM, prompts: list[list[int]]) -> list[float]:
    """The wall time of each step after the first (the prompts' prefill), every request decoding in it."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--quantize-activations", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, {args.model}, quantization "
          f"{args.quantization}, int8 activations {args.quantize_activations}, KV {args.kv_cache_dtype}")
    engines = {mode: LLM(args.model, quantization=args.quantization, quantize_activations=args.quantize_activations,
                         kv_cache_dtype=args.kv_cache_dtype, enforce_eager=mode == "eager", max_num_seqs=32)
               for mode in ("eager", "graphs")}
    rng = random.Random(0)
    print("streams   eager ms/step  graphs ms/step  eager / graphs")
    for streams in map(int, args.streams.split(",")):
        prompts = [[rng.randrange(100, 40_000) for _ in range(PROMPT_LEN)] for _ in range(streams)]
        times: dict[str, list[float]] = {mode: [] for mode in engines}
        for mode, llm in engines.items():  # warm-up: kernels built, graphs recorded
            decode_step_ms(llm, prompts)
        for _ in range(args.rounds):
            for mode, llm in engines.items():
                times[mode] += decode_step_ms(llm, prompts)
        eager, graphs = (statistics.median(times[mode]) for mode in ("eager", "graphs"))
        print(f"{streams:7d}  {eager:15.2f}  {graphs:15.2f}  {eager / graphs:13.2f}x", flush=True)


if __name__ == "__main__":
    main()
