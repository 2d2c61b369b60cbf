"""N-gram speculative decoding against plain decoding, same run: one greedy chat request that repeats its
prompt (a code edit), single stream, SmolLM2-135M. Checks the outputs are token-identical and reports tok/s,
the ratio and the acceptance counters.

    PYTHONPATH=. python benchmarks/spec_decode.py [--max-tokens 128] [--k 4] [--repeats 3]
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


def measure(llm: LLM, params: SamplingParams, repeats: int) -> tuple[list[int], float]:
    """The output's token ids and the median tok/s over ``repeats`` timed runs, after one warm-up."""
    llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4))
    rates, token_ids = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        token_ids = llm.chat(MESSAGES, params)[0].outputs[0].token_ids
        rates.append(len(token_ids) / (time.perf_counter() - start))
    return token_ids, statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain_ids, plain_rate = measure(LLM(args.model, dtype="float32"), params, args.repeats)
    spec = LLM(args.model, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    spec_ids, spec_rate = measure(spec, params, args.repeats)
    assert spec_ids == plain_ids, "speculation changed the greedy output"
    stats = {k: round(v, 3) for k, v in spec.stats().items() if k.startswith("spec_decode")}
    print(f"{len(plain_ids)} tokens: plain {plain_rate:.1f} tok/s, ngram k={args.k} {spec_rate:.1f} tok/s "
          f"({spec_rate / plain_rate:.2f}x), token-identical; {stats}")


if __name__ == "__main__":
    main()
