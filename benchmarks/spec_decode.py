"""N-gram (or draft-model) speculative decoding against plain decoding, same run, taking turns: one greedy chat
request that repeats its prompt (a code edit), single stream, SmolLM2-135M. Checks the outputs are
token-identical and reports tok/s, the ratio and the acceptance counters.

    PYTHONPATH=. python benchmarks/spec_decode.py [--max-tokens 128] [--k 4] [--repeats 3] [--draft-model PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvserve import LLM, SamplingParams

CODE = """def merge_sorted(a, b):
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result
"""
MESSAGES = [{"role": "user", "content": "Rewrite this function with the variable `result` renamed to `merged`. "
             "Output only the code.\n\n" + CODE}]


def timed_run(llm: LLM, params: SamplingParams) -> tuple[list[int], float]:
    """The output's token ids and its tok/s."""
    start = time.perf_counter()
    token_ids = llm.chat(MESSAGES, params)[0].outputs[0].token_ids
    return token_ids, len(token_ids) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft-model", default=None, help="draft-model speculation with this model, not ngram")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    method = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4} if args.draft_model is None else {
        "method": "draft", "model": args.draft_model}
    plain = LLM(args.model, dtype="float32", kv_cache_memory=0.5)
    spec = LLM(args.model, dtype="float32", kv_cache_memory=0.5,
               speculative_config={**method, "num_speculative_tokens": args.k})
    for llm in (plain, spec):  # warm-up: step graphs recorded, the prompt cached
        llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4))
    plain_rates, spec_rates = [], []
    for _ in range(args.repeats):  # taking turns, so that both see the same load on a shared machine
        plain_ids, rate = timed_run(plain, params)
        plain_rates.append(rate)
        spec_ids, rate = timed_run(spec, params)
        spec_rates.append(rate)
        assert spec_ids == plain_ids, "speculation changed the greedy output"
    plain_rate, spec_rate = statistics.median(plain_rates), statistics.median(spec_rates)
    ratios = sorted(round(s / p, 2) for s, p in zip(spec_rates, plain_rates))
    stats = {k: round(v, 3) for k, v in spec.stats().items() if k.startswith("spec_decode")}
    print(f"{len(plain_ids)} tokens: plain {plain_rate:.1f} tok/s, {method['method']} k={args.k} {spec_rate:.1f} "
          f"tok/s ({spec_rate / plain_rate:.2f}x; per turn {ratios}), token-identical; {stats}")


if __name__ == "__main__":
    main()
