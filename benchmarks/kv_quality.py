"""What quantized KV costs in quality: perplexity on a fixed text and greedy agreement with the fp32 cache, per
``--kv-cache-dtype``, on a pulled model.

    PYTHONPATH=. python benchmarks/kv_quality.py [--model smollm2-135m-instruct] [--tokens 2048]
        [--prompts 8] [--max-tokens 64] [--chunk 256]

The fixed text is the conversations of ``kvserve/bench/data/sharegpt_sample.json`` joined in order (kvserve's own
ShareGPT-shaped sample, so it is the same on every machine), cut to ``--tokens`` tokens. Its perplexity comes from
each prompt token's logprob (``prompt_logprobs``) in prefill chunks of ``--chunk`` tokens, so that every chunk
attends the quantized K/V of the chunks before it as well as its own, as a served prompt does. Greedy agreement:
``--prompts`` of the sample's human turns, each decoded greedily for ``--max-tokens``; per encoding, how many of
them equal the fp32 cache's output exactly and the mean fraction of tokens before the first difference.
"""

from __future__ import annotations

import argparse
import json
import math

from kvserve import LLM, SamplingParams
from kvserve.bench.datasets import SHAREGPT_SAMPLE

ENCODINGS = ("auto", "int8", "fp8", "int4")


def sample_turns() -> list[dict[str, str]]:
    return [turn for conversation in json.loads(SHAREGPT_SAMPLE.read_text()) for turn in conversation["conversations"]]


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    """exp of the mean negative logprob of tokens 1.. given the ones before them."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    logprobs = [position[token].logprob for token, position in zip(token_ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """How many outputs equal their reference; the mean fraction of each before its first difference."""
    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    exact = sum(a == b for a, b in zip(outputs, reference))
    return exact, sum(common(a, b) / len(b) for a, b in zip(outputs, reference)) / len(reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the fixed text")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens)")
    args = parser.parse_args()
    turns = sample_turns()
    prompts = [turn["value"] for turn in turns if turn["from"] == "human"][: args.prompts]
    results: dict[str, tuple[float, list[list[int]]]] = {}
    for name in ENCODINGS:
        llm = LLM(args.model, kv_cache_dtype=name, enable_prefix_caching=False, max_num_batched_tokens=args.chunk)
        text_ids = llm.get_tokenizer().encode("\n\n".join(turn["value"] for turn in turns))[: args.tokens]
        results[name] = perplexity(llm, text_ids), greedy(llm, prompts, args.max_tokens)
        del llm
    reference_ppl, reference = results["auto"]
    print(f"{args.model}: perplexity of {len(text_ids)} tokens of the fixed text (prefill chunks of {args.chunk}); "
          f"{len(prompts)} prompts x {args.max_tokens} greedy tokens against the fp32 cache")
    print(f"  {'kv':5s} {'perplexity':>10s} {'vs fp32':>8s} {'greedy equal':>13s} {'tokens before a difference':>27s}")
    for name, (ppl, outputs) in results.items():
        exact, before = agreement(outputs, reference)
        print(f"  {name:5s} {ppl:10.4f} {ppl / reference_ppl - 1:+8.2%} {exact:>6d} of {len(prompts):<4d} {before:>27.1%}")


if __name__ == "__main__":
    main()
