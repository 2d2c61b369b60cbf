"""Served embeddings a second: the same texts sent to several running servers' OpenAI-shaped /v1/embeddings, in
requests of ``--batch`` inputs, ``--concurrency`` at a time, the servers taking turns in each round; each server's
texts/s and prompt tok/s (its own usage count), and the worst cosine similarity of its vectors to the first
server's (the same model and pooling should agree).

    kvserve serve --port 8001 --no-enable-prefix-caching &          # last-token pooling, normalized: the default
    llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf --port 8002 --embeddings --pooling last -t 2 -tb 2 \\
        -ub 2048 -b 2048 -c 8192 -np 8 &                              # the same file, the same pooling
    python benchmarks/embed_served.py --server kvserve=http://127.0.0.1:8001 \\
        --server llamacpp=http://127.0.0.1:8002 --rounds 3

The texts are cut from kvserve's seeded corpus, ``--min-words .. --max-words`` words each (``kvserve pull`` fetches
the model; benchmarks/peers/README.md says how to build llama-server), the same texts every round: kvserve's prefix
cache is off above so that no round reuses the KV of the one before (left on, a repeated text is a cache hit).
Wall-clock seconds on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx
import torch

from kvserve.bench.report import machine
from kvserve.model.checkpoint import CORPUS


def make_texts(count: int, min_words: int, max_words: int, seed: int) -> list[str]:
    words = " ".join(CORPUS * (1 + 4 * max_words // len(" ".join(CORPUS).split()))).split()
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        length = rng.randint(min_words, max_words)
        start = rng.randrange(len(words) - length)
        texts.append(" ".join(words[start:start + length]))
    return texts


async def embed_all(url: str, texts: list[str], batch: int, concurrency: int) -> tuple[float, int, torch.Tensor]:
    """Seconds to embed every text, the prompt tokens the server counted, and the vectors in order."""
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    vectors: list[list[list[float]]] = [[] for _ in batches]
    tokens = [0] * len(batches)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]  # the name the server answers to

        async def one(index: int) -> None:
            async with gate:
                answer = await client.post("/v1/embeddings", json={"model": model, "input": batches[index]})
                answer.raise_for_status()
                body = answer.json()
                vectors[index] = [item["embedding"] for item in sorted(body["data"], key=lambda d: d["index"])]
                tokens[index] = body["usage"]["prompt_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(batches))))
        seconds = time.perf_counter() - start
    return seconds, sum(tokens), torch.tensor([v for part in vectors for v in part])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="NAME=URL, one per server (the first: "
                        "the vectors the others are compared to)")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--min-words", type=int, default=8)
    parser.add_argument("--max-words", type=int, default=160)
    parser.add_argument("--batch", type=int, default=16, help="inputs a request")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    servers = dict(entry.split("=", 1) for entry in args.server)
    texts = make_texts(args.texts, args.min_words, args.max_words, args.seed)
    for url in servers.values():  # warm-up
        asyncio.run(embed_all(url, texts[: args.batch], args.batch, 1))
    seconds: dict[str, list[float]] = {name: [] for name in servers}
    tokens: dict[str, int] = {}
    vectors: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for name, url in servers.items():
            took, tokens[name], vectors[name] = asyncio.run(embed_all(url, texts, args.batch, args.concurrency))
            seconds[name].append(took)
    first = next(iter(servers))
    print(f"# {machine()}; {args.texts} texts of {args.min_words}-{args.max_words} words, {args.batch} a request, "
          f"{args.concurrency} requests at a time, {args.rounds} rounds taking turns")
    for name, times in seconds.items():
        median = statistics.median(times)
        agreement = torch.nn.functional.cosine_similarity(vectors[name], vectors[first], dim=-1).min().item()
        print(f"{name:12s} {args.texts / median:8.2f} texts/s  {tokens[name] / median:9.1f} prompt tok/s "
              f"({tokens[name]} tokens)  {statistics.median(seconds[first]) / median:5.2f}x {first}  worst cosine "
              f"to {first} {agreement:.5f}  (rounds: {', '.join(f'{t:.2f} s' for t in times)})")


if __name__ == "__main__":
    main()
