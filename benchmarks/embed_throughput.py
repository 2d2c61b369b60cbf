"""Embeddings a second: kvserve's pooling requests (``LLM.embed``, last-token pooling, normalized) against
transformers' batched forward on the same weights (fp32, the model's ``last_hidden_state`` at each prompt's last
token, normalized: what a sentence-embedding loop over a causal model does, prompts sorted by length and batched as
sentence-transformers batches them), on this CPU, the systems taking turns in each round.

    python benchmarks/embed_throughput.py --rounds 3

Systems: ``kvserve`` (the model as kvserve loads it: the default model's shipped Q4_1 blocks), ``kvserve-f32``
(``--quantization none``: the blocks dequantized at load, as transformers reads the GGUF) and ``transformers``. The
prompts are cut from kvserve's seeded corpus at lengths spread over ``--min-len .. --max-len`` tokens; the prefix
cache is off, so that no round reuses another's KV (prompts cut from one text share beginnings). Each system's
vectors are checked against transformers' (the worst cosine similarity over the prompts is printed).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvserve import LLM
from kvserve.bench.hf_backend import load_hf_model
from kvserve.bench.report import machine
from kvserve.model.checkpoint import CORPUS


def make_prompts(tokenizer, count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """``count`` token-id prompts of lengths spread over ``min_len .. max_len``, each from a random corpus place."""
    text = " ".join(CORPUS * (1 + 4 * max_len // len(" ".join(CORPUS))))
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(min_len, max_len)
        start = rng.randrange(len(ids) - length)
        prompts.append(ids[start:start + length])
    return prompts


def kvserve_embeddings(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    return torch.tensor([out.outputs.embedding for out in outputs])


@torch.inference_mode()
def transformers_embeddings(model: torch.nn.Module, prompts: list[list[int]], batch_size: int,
                            pad_token_id: int) -> torch.Tensor:
    """Batches of prompts of like lengths (sorted, as sentence-transformers does), right-padded; each prompt's last
    token's final hidden state, normalized."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    vectors: list[torch.Tensor | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
            mask[row, : len(prompts[i])] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = mask.sum(dim=1) - 1
        pooled = torch.nn.functional.normalize(hidden[torch.arange(len(batch)), last], dim=-1)
        for row, i in enumerate(batch):
            vectors[i] = pooled[row]
    return torch.stack(vectors)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="transformers' batch (sentence-transformers': 32)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="kvserve's step budget")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    options = {"enable_prefix_caching": False, "max_num_batched_tokens": args.max_num_batched_tokens}
    engines = {"kvserve": LLM(args.model, **options), "kvserve-f32": LLM(args.model, quantization="none", **options)}
    hf = load_hf_model(args.model, torch.float32, torch.device("cpu"))
    tokenizer = engines["kvserve"].get_tokenizer()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = make_prompts(tokenizer, args.prompts, args.min_len, args.max_len, args.seed)
    runs = {name: (lambda llm=llm: kvserve_embeddings(llm, prompts)) for name, llm in engines.items()}
    runs["transformers"] = lambda: transformers_embeddings(hf, prompts, args.batch_size, pad)
    for run in runs.values():  # warm-up: step graphs, allocator, dense layouts
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    vectors: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            vectors[name] = run()
            seconds[name].append(time.perf_counter() - start)
    num_tokens = sum(map(len, prompts))
    print(f"# {machine()}; {args.model}, {args.prompts} prompts of {args.min_len}-{args.max_len} tokens "
          f"({num_tokens} in all), torch threads {torch.get_num_threads()}, {args.rounds} rounds taking turns")
    baseline = statistics.median(seconds["transformers"])
    for name, times in seconds.items():
        median = statistics.median(times)
        agreement = torch.nn.functional.cosine_similarity(vectors[name], vectors["transformers"], dim=-1).min()
        print(f"{name:13s} {num_tokens / median:9.1f} prompt tok/s  {args.prompts / median:7.2f} prompts/s  "
              f"{baseline / median:5.2f}x transformers  worst cosine to transformers {agreement.item():.6f}  "
              f"(rounds: {', '.join(f'{t:.2f} s' for t in times)})")


if __name__ == "__main__":
    main()
