"""One layer of each CPU attention backend on the issue-6 shapes, in the same run.

    python benchmarks/attention_backends.py [--threads N]

Shapes (SmolLM2-135M): 9 query heads, 3 KV heads, head_dim 64, block_size 16, shuffled block tables, fp32.
Cases: 32 decodes at contexts 380..500 (mean ~440), a fresh 512-token prefill chunk, a 512-token chunk after
440 cached tokens, and the decodes with the fresh chunk in one step. The cache has NUM_LAYERS layers (30, as
the model), so a layer's K/V comes from memory as in a real step rather than from the last-level cache that
one layer's ~20 MB would fit in. Each time is a pass of ``forward`` (KV write + attention) over every layer,
divided by NUM_LAYERS: the best of NUM_ROUNDS rounds that alternate the columns, after a warm-up pass each.
Columns: ``torch_ref`` (gather + SDPA), ``cpu_paged`` (decodes in place, chunks through SDPA), and
``kernel_as_prefill``: the decode kernel run once per query of the chunks (each query as a one-token sequence
over its causal prefix), i.e. what sending prefill through the same kernel would cost.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from typing import Callable

import torch

from attention_torch_ref import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, make_inputs
from kvserve.attention.backend import AttentionBackend, AttentionInputs
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage

NUM_LAYERS = 30
NUM_ROUNDS = 8


def queries_as_decodes(inputs: AttentionInputs) -> AttentionInputs:
    """Every query token of the step as a one-token sequence over its own causal prefix (same blocks)."""
    rows = [(i, s - n + j + 1) for i, (n, s) in enumerate(zip(inputs.query_lens_list, inputs.seq_lens_list))
            for j in range(n)]
    seq_lens = [s for _, s in rows]
    return AttentionInputs(
        num_decodes=len(rows),
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=inputs.block_tables[[i for i, _ in rows]],
        slot_mapping=inputs.slot_mapping,
        query_lens_list=[1] * len(rows),
        seq_lens_list=seq_lens,
        block_size=inputs.block_size,
    )


def interleaved_ms(passes: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best time of each pass (after one warm-up pass each) over NUM_ROUNDS rounds that run every pass once
    in turn, so that load from other processes on a shared machine hits all columns alike."""
    for run_pass in passes.values():
        run_pass()
    best = dict.fromkeys(passes, math.inf)
    for _ in range(NUM_ROUNDS):
        for name, run_pass in passes.items():
            start = time.perf_counter()
            run_pass()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def layer_forward(backend: AttentionBackend, inputs: AttentionInputs, q, k, v, kv: KVCacheStorage
                  ) -> Callable[[int], torch.Tensor]:
    meta = backend.build_metadata(inputs, {None})
    return lambda layer: backend.forward(q, k, v, layer, kv, meta, scale=HEAD_DIM**-0.5)


def every_layer(forward: Callable[[int], torch.Tensor]) -> None:
    for layer in range(NUM_LAYERS):
        forward(layer)


def run_case(name: str, seqs: list[tuple[int, int]], num_decodes: int) -> None:
    inputs = make_inputs(seqs, num_decodes, "cpu")
    kv = KVCacheStorage(KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32),
                        int(inputs.block_tables.max()) + 1, "cpu")
    slots = torch.arange(kv.num_slots)
    for layer in range(NUM_LAYERS):
        kv.write(layer, slots, *(torch.randn(kv.num_slots, NUM_KV_HEADS, HEAD_DIM) for _ in "kv"))
    q = torch.randn(inputs.num_tokens, NUM_HEADS, HEAD_DIM)
    k, v = (torch.randn(inputs.num_tokens, NUM_KV_HEADS, HEAD_DIM) for _ in range(2))
    backends = {"torch_ref": (TorchRefBackend(), inputs), "cpu_paged": (CpuPagedBackend(), inputs)}
    if num_decodes < len(seqs):
        backends["kernel_as_prefill"] = (CpuPagedBackend(), queries_as_decodes(inputs))
    forwards = {key: layer_forward(backend, step_inputs, q, k, v, kv)
                for key, (backend, step_inputs) in backends.items()}
    for key, forward in forwards.items():
        torch.testing.assert_close(forward(0), forwards["torch_ref"](0), atol=1e-4, rtol=1e-4, msg=key)
    passes = {key: functools.partial(every_layer, forward) for key, forward in forwards.items()}
    times = {key: ms / NUM_LAYERS for key, ms in interleaved_ms(passes).items()}
    kv_mb = sum(inputs.seq_lens_list) * NUM_KV_HEADS * HEAD_DIM * 4 * 2 / 1e6
    cols = "  ".join(f"{key} {ms:6.2f} ms" for key, ms in times.items())
    print(f"{name:34s} K/V {kv_mb:4.1f} MB/layer  {cols}  torch_ref/cpu_paged "
          f"{times['torch_ref'] / times['cpu_paged']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    decodes = [(int(c), 1) for c in torch.randint(380, 501, (32,))]
    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    run_case("32 decodes", decodes, 32)
    run_case("512-token chunk, no context", [(0, 512)], 0)
    run_case("512-token chunk after 440 cached", [(440, 512)], 0)
    run_case("32 decodes + 512-token chunk", decodes + [(0, 512)], 32)


if __name__ == "__main__":
    main()
