"""Quantized KV on CPU: the tokens a KV budget holds per encoding, and the decode attention time per layer.

    PYTHONPATH=. python benchmarks/kv_quant.py [--kv-cache-memory 2] [--seqs 32] [--context 1000] [--rounds 7]
        [--layers 1] [--shuffle-blocks] [--baseline DIR]

``--baseline DIR`` also times the decode kernel built from DIR (another revision's ``kvserve/attention/csrc``,
e.g. in a ``git worktree add`` of it, so that the headers it includes from ``kvserve/kv/csrc`` resolve there;
revisions before 2026-11-28 include only ``kv_vectors.h``, so ``git show REV:<path>`` of it and of
``paged_decode.c`` into one folder also does), the two builds taking turns in each round of one process, so that
both see the same machine load.

Shapes are SmolLM2-135M's (30 layers, 9 query heads on 3 KV heads, head_dim 64, blocks of 16). The budget is
sized by the engine's own ``num_kv_blocks_for``; the decode time is ``CpuPagedBackend.forward`` for one layer of
a decode step (the step's 32 new K/V written, quantized, then attention over every sequence's context), the
median of interleaved rounds so that every encoding sees the same machine load. With one layer its K/V stays in
the CPU's caches from call to call; ``--layers N`` gives each of N layers a cache of its own and times a step's
pass over all of them, per layer, so that K/V comes from memory as in a served step (SmolLM2 at 16 x 2,000
tokens: 1.5 GB of fp32 K/V a step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvserve.attention.backend import AttentionInputs
from kvserve.attention.cpu_paged import DECODE_SOURCE, PREFILL_SOURCE, CpuPagedBackend
from kvserve.config import CacheConfig
from kvserve.engine.kv_budget import num_kv_blocks_for
from kvserve.kv.quant import kv_cache_dtype
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from kvserve.native import load_library

NUM_LAYERS, NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE = 30, 3, 3, 64, 16
NAMES = ("auto", "int8", "fp8", "int4")


def spec_for(name: str, num_layers: int = NUM_LAYERS) -> KVCacheSpec:
    return KVCacheSpec(num_layers, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32,
                       kv_cache_dtype(name, torch.float32))


def tokens_held(budget_gib: float) -> dict[str, int]:
    cache = CacheConfig(kv_cache_memory=budget_gib)
    return {name: num_kv_blocks_for(cache, spec_for(name).bytes_per_block, torch.device("cpu"), 2**40) * BLOCK_SIZE
            for name in NAMES}


def decode_step(name: str, num_seqs: int, context: int,
                shuffled: bool = False) -> tuple[KVCacheStorage, AttentionInputs, torch.Tensor]:
    """A cache of one layer holding num_seqs random contexts, each in consecutive blocks as a fresh pool hands
    them out (``shuffled``: blocks in random order, as a long-running pool's free list may), and the step's
    decode inputs."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    kv = KVCacheStorage(spec_for(name, 1), num_seqs * blocks_per_seq, "cpu")
    order = torch.randperm(kv.num_blocks, generator=gen) if shuffled else torch.arange(kv.num_blocks)
    tables = order.view(num_seqs, blocks_per_seq)
    positions = torch.arange(context + 1)
    slots = tables[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE  # [num_seqs, context + 1]
    history = slots[:, :context].flatten()
    kv.write(0, history, *(torch.randn(history.numel(), NUM_KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv"))
    inputs = AttentionInputs(
        num_decodes=num_seqs, query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.full((num_seqs,), context + 1, dtype=torch.int32), block_tables=tables.to(torch.int32),
        slot_mapping=slots[:, context].contiguous(), query_lens_list=[1] * num_seqs,
        seq_lens_list=[context + 1] * num_seqs, block_size=BLOCK_SIZE,
    )
    q = torch.randn(num_seqs, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    return kv, inputs, q


def backends(baseline: Path | None) -> dict[str, CpuPagedBackend]:
    """This revision's kernels, and where a baseline folder is given, its decode kernel beside them."""
    kinds = {"": CpuPagedBackend()}
    if baseline is not None:
        libraries = (load_library(baseline / DECODE_SOURCE.name), load_library(PREFILL_SOURCE))
        kinds[" (baseline)"] = CpuPagedBackend(libraries)
    return kinds


def decode_ms(num_seqs: int, context: int, rounds: int, num_layers: int = 1, shuffled: bool = False,
              baseline: Path | None = None) -> dict[str, float]:
    """Per encoding (and kernel build), the median ms a layer of a decode step over ``num_layers`` layers'
    caches."""
    kinds = backends(baseline)
    steps = {name: [decode_step(name, num_seqs, context, shuffled) for _ in range(num_layers)] for name in NAMES}
    new_kv = torch.randn(2, num_seqs, NUM_KV_HEADS, HEAD_DIM)
    times: dict[str, list[float]] = {name + kind: [] for name in NAMES for kind in kinds}
    for round_ in range(rounds):
        for name, layers in steps.items():
            for kind, backend in sorted(kinds.items(), reverse=round_ % 2 == 1):  # the builds take turns first
                metas = [backend.build_metadata(inputs, {None}) for _, inputs, _ in layers]
                for _ in range(2):  # warm: the first call pulls the cache in as the last encoding evicted it
                    start = time.perf_counter()
                    for (kv, _, q), meta in zip(layers, metas):
                        backend.forward(q, new_kv[0], new_kv[1], 0, kv, meta, scale=HEAD_DIM**-0.5)
                    elapsed = time.perf_counter() - start
                times[name + kind].append(elapsed * 1e3 / num_layers)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=1, help="layers of a step, each its own cache")
    parser.add_argument("--shuffle-blocks", action="store_true", help="each sequence's blocks in random order")
    parser.add_argument("--baseline", type=Path, help="another revision's kvserve/attention/csrc folder")
    args = parser.parse_args()
    held = tokens_held(args.kv_cache_memory)
    print(f"tokens held by {args.kv_cache_memory} GiB (SmolLM2 shapes, {torch.get_num_threads()} threads):")
    for name, tokens in held.items():
        print(f"  {name:5s} {tokens:>10,d}  {tokens / held['auto']:.2f}x")
    kv_bytes = {name: spec_for(name, 1).bytes_per_block * args.seqs * -(-(args.context + 1) // BLOCK_SIZE)
                for name in NAMES}
    print(f"decode attention, a layer of {args.layers}, {args.seqs} sequences x {args.context} tokens "
          f"(median of {args.rounds}):")
    times = decode_ms(args.seqs, args.context, args.rounds, args.layers, args.shuffle_blocks, args.baseline)
    for label, ms in times.items():
        name = label.split()[0]
        baseline_ms = times.get(name + " (baseline)") if label == name else None
        against = f"  baseline / this {baseline_ms / ms:.2f}x" if baseline_ms else ""
        print(f"  {label:16s} {ms:7.3f} ms  {kv_bytes[name] / 2**20:6.1f} MiB of K/V  "
              f"{kv_bytes[name] / ms / 1e6:5.1f} GB/s{against}")


if __name__ == "__main__":
    main()
