"""How long a running stream stalls while other clients send the server input work: one streamed completion's
gaps between tokens, while (a) N clients loop /tokenize calls on a long text for T seconds, or (b) one client
sends a batch of long prompts whose last is too long for the model (tokenized, then refused). Session 46: both
ran on the engine thread between two steps, and the stream got no token for as long as they lasted.

Start the server first (OMP_NUM_THREADS=1 keeps its kernels' threads from spinning on a small machine), then:

    OMP_NUM_THREADS=1 kvserve serve smollm2-135m-instruct --port 8745 &
    python benchmarks/stream_stalls.py --url http://127.0.0.1:8745 tokenize --clients 2 --seconds 10
    python benchmarks/stream_stalls.py --url http://127.0.0.1:8745 batch --prompts 450
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jovial bard".split()
HEAD_START_S = 2.0  # the stream runs alone this long first: its own gaps before the load are the baseline


def words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def stream_gaps(client: httpx.AsyncClient, url: str, max_tokens: int) -> list[tuple[float, float]]:
    """(gap, time) for each token of one greedy streamed completion after its first."""
    body = {"model": "", "prompt": "Tell me a long story about a cat.", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    gaps, last = [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now - last, now))
                last = now
    return gaps


async def tokenize_loop(client: httpx.AsyncClient, url: str, text: str, until: float) -> int:
    await asyncio.sleep(HEAD_START_S)
    calls = 0
    while time.perf_counter() < until:
        (await client.post(f"{url}/tokenize", json={"model": "", "prompt": text})).raise_for_status()
        calls += 1
    return calls


async def refused_batch(client: httpx.AsyncClient, url: str, num_prompts: int, rng: random.Random) -> str:
    await asyncio.sleep(HEAD_START_S)
    prompts = [words(1500, rng)] * num_prompts + [words(10000, rng)]  # the last is over SmolLM2's 8k tokens
    start = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json={"model": "", "prompt": prompts, "max_tokens": 1})
    return f"batch of {num_prompts + 1} prompts: HTTP {response.status_code} after {time.perf_counter() - start:.2f} s"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--max-tokens", type=int, default=400, help="of the stream measured")
    load = parser.add_subparsers(dest="load", required=True)
    flood = load.add_parser("tokenize", help="N clients looping /tokenize")
    flood.add_argument("--clients", type=int, default=2)
    flood.add_argument("--seconds", type=float, default=10.0)
    flood.add_argument("--chars", type=int, default=200_000, help="of each /tokenize text")
    batch = load.add_parser("batch", help="one batch of long prompts, refused after it is tokenized")
    batch.add_argument("--prompts", type=int, default=450)
    args = parser.parse_args()
    rng = random.Random(0)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        if args.load == "tokenize":
            text, until = words(args.chars // 4, rng)[: args.chars], start + HEAD_START_S + args.seconds
            gaps, *calls = await asyncio.gather(stream_gaps(client, args.url, args.max_tokens),
                                                *[tokenize_loop(client, args.url, text, until)
                                                  for _ in range(args.clients)])
            print(f"{args.clients} clients looping /tokenize ({len(text)} characters) for {args.seconds:g} s: "
                  f"{sum(calls)} calls; stream tokens meanwhile: "
                  f"{sum(1 for _, at in gaps if start + HEAD_START_S <= at < until)}")
        else:
            gaps, line = await asyncio.gather(stream_gaps(client, args.url, args.max_tokens),
                                              refused_batch(client, args.url, args.prompts, rng))
            print(line)
    before = [gap for gap, at in gaps if at < start + HEAD_START_S]
    print(f"stream: longest gap {max(gap for gap, _ in gaps):.3f} s (alone, before the load: "
          f"{max(before, default=float('nan')):.3f} s); gaps over 0.3 s (s, at s): "
          f"{[(round(gap, 2), round(at - start, 1)) for gap, at in gaps if gap > 0.3]}")


if __name__ == "__main__":
    asyncio.run(main())
