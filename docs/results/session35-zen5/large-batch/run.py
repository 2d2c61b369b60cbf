"""Offline generation at a large batch of a tiny llama with SmolLM2's vocabulary (hidden 64, 2 layers, 49,152
tokens: a step is mostly host work and [256, 49,152] logits, as on a GPU), this tree against another taking
turns, each run its own process.

    python run.py --make CHECKPOINT                      # once: the seeded llama, into the folder CHECKPOINT
    python run.py CHECKPOINT --baseline TREE [--rounds 3] [--sampling greedy|top_p]

Prints output tok/s per run: 256 requests of 128 random prompt tokens, 128 tokens out each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[3]


def one_run(checkpoint: str, sampling: str) -> float:
    import torch

    from kvserve import LLM, SamplingParams

    torch.manual_seed(0)
    llm = LLM(checkpoint, dtype="float32", max_num_seqs=256, num_kv_blocks=4096, max_model_len=512)
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0.0 if sampling == "greedy" else 0.8,
                            top_p=1.0 if sampling == "greedy" else 0.9, seed=None)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (128,)).tolist()} for _ in range(256)]
    llm.generate(prompts[:16], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def make_checkpoint(folder: str) -> None:
    """``kvserve make-checkpoint``'s tiny llama, its tokenizer padded to 49,152 tokens."""
    from dataclasses import replace

    from kvserve.model import checkpoint

    size = replace(checkpoint._SIZES["tiny"], vocab_size=49_152, max_position_embeddings=1024)
    tokenizer = checkpoint._train_tokenizer(512, pad_to=49_152)
    checkpoint._random_model("llama", size, tokenizer, 0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> None:
    if sys.argv[1:2] == ["--make"]:
        return make_checkpoint(sys.argv[2])
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sampling", default="greedy", choices=["greedy", "top_p"])
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(f"{one_run(args.checkpoint, args.sampling):.1f}")
        return
    for round_ in range(args.rounds):
        for name, tree in (("this tree", REPO), ("baseline", Path(args.baseline))):
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run([sys.executable, str(HERE), args.checkpoint, "--baseline", args.baseline,
                                  "--sampling", args.sampling, "--one"], env=env, cwd="/tmp", capture_output=True,
                                 text=True, check=True)
            print(f"round {round_ + 1} {name}: {out.stdout.strip()} output tok/s ({args.sampling})", flush=True)


if __name__ == "__main__":
    main()
