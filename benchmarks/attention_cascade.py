"""Decodes that share a cached prefix, through the CPU decode kernel: shared blocks vs private copies.

    python benchmarks/attention_cascade.py [--threads N] [--num-decodes 16] [--prefix-len 1024]
    python benchmarks/attention_cascade.py --baseline DIR   # also the decode kernel of another revision's
                                                            # kvserve/attention/csrc (a worktree's), taking turns

The `prefix` workload's decode step at SmolLM2-135M's shapes (9 query / 3 KV heads, head_dim 64, block 16,
fp32): NUM_DECODES sequences of PREFIX_LEN shared tokens plus 32..96 tokens of their own. ``shared``: their block
tables start with the same blocks, as prefix-cache hits do, so the kernel attends those keys once per KV head
for the whole group; ``private``: the same contexts in blocks of their own (what the prefix cache off gives).
The cache has 30 layers, as the model, so K/V comes from memory; each time is one pass over every layer
divided by 30, the best of 8 rounds that alternate the two layouts.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvserve.attention.backend import AttentionInputs
from kvserve.attention.cpu_paged import DECODE_SOURCE, PREFILL_SOURCE, CpuPagedBackend
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from kvserve.native import load_library

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16
NUM_ROUNDS = 8


def decode_step(tables: list[list[int]], seq_lens: list[int]) -> AttentionInputs:
    width = max(len(t) for t in tables)
    slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for t, n in zip(tables, seq_lens)]
    return AttentionInputs(
        num_decodes=len(tables),
        query_start_loc=torch.arange(len(tables) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_lens_list=[1] * len(tables),
        seq_lens_list=seq_lens,
        block_size=BLOCK_SIZE,
    )


def layouts(num_decodes: int, prefix_len: int) -> tuple[dict[str, AttentionInputs], list[tuple[int, int]]]:
    """Both layouts over one shuffled pool of blocks, and the (shared, private) block pairs whose contents
    must be equal."""
    seq_lens = [prefix_len + 32 + (64 * i) // max(num_decodes - 1, 1) for i in range(num_decodes)]
    own_blocks = [-(-n // BLOCK_SIZE) - prefix_len // BLOCK_SIZE for n in seq_lens]
    prefix_blocks = prefix_len // BLOCK_SIZE
    pool = torch.randperm(prefix_blocks * (num_decodes + 1) + sum(own_blocks), generator=torch.Generator().manual_seed(0)).tolist()
    shared_prefix, pool = pool[:prefix_blocks], pool[prefix_blocks:]
    shared, private, copies = [], [], []
    for n in own_blocks:
        own, pool = pool[:n], pool[n:]
        copy, pool = pool[:prefix_blocks], pool[prefix_blocks:]
        shared.append(shared_prefix + own)
        private.append(copy + own)
        copies += zip(shared_prefix, copy)
    return {"shared": decode_step(shared, seq_lens), "private": decode_step(private, seq_lens)}, copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-decodes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--baseline", type=Path, help="another revision's kvserve/attention/csrc folder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps, copies = layouts(args.num_decodes, args.prefix_len)
    num_blocks = max(int(s.block_tables.max()) for s in steps.values()) + 1
    kv = KVCacheStorage(KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32), num_blocks, "cpu")
    slots = torch.arange(kv.num_slots)
    for layer in range(NUM_LAYERS):
        kv.write(layer, slots, *(torch.randn(kv.num_slots, NUM_KV_HEADS, HEAD_DIM) for _ in "kv"))
    kv.copy_blocks(tuple(copies))
    backends = {"": CpuPagedBackend()}
    if args.baseline:
        decode, prefill = (load_library(args.baseline / source.name) for source in (DECODE_SOURCE, PREFILL_SOURCE))
        backends["baseline "] = CpuPagedBackend((decode, prefill))
    q = torch.randn(args.num_decodes, NUM_HEADS, HEAD_DIM)
    k, v = torch.randn(2, args.num_decodes, NUM_KV_HEADS, HEAD_DIM)
    runs = {(prefix + name, backend): backend.build_metadata(inputs, {None})
            for prefix, backend in backends.items() for name, inputs in steps.items()}
    outs, best = {}, {name: float("inf") for name, _ in runs}
    for _ in range(NUM_ROUNDS):
        for (name, backend), meta in runs.items():
            start = time.perf_counter()
            for layer in range(NUM_LAYERS):
                outs[name] = backend.forward(q, k, v, layer, kv, meta, scale=HEAD_DIM**-0.5)
            best[name] = min(best[name], (time.perf_counter() - start) / NUM_LAYERS)
    for name in outs:  # same keys, same result
        torch.testing.assert_close(outs[name], outs["private"], atol=1e-5, rtol=1e-5)
    print(f"{args.num_decodes} decodes, {args.prefix_len}-token shared prefix, {args.threads} threads, ms per layer:")
    for name, seconds in best.items():
        print(f"  {name:17s} {seconds * 1e3:7.3f}")
    print(f"  shared is {best['private'] / best['shared']:.2f}x private")
    if args.baseline:
        print(f"  shared is {best['baseline shared'] / best['shared']:.2f}x the baseline's shared")


if __name__ == "__main__":
    main()
