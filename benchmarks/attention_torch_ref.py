"""Per-layer cost of TorchRefBackend against a naive per-sequence loop, on the CPU product's shapes.

    python benchmarks/attention_torch_ref.py [--threads N] [--device cpu|cuda]

Shapes: 9 query heads, 3 KV heads, head_dim 64, block_size 16, shuffled block tables. Cases: 64 decodes at
contexts 350..450 alone, then with two 256-token prefill chunks (one fresh, one after 544 cached tokens).
Each time is one layer's ``forward`` (KV write + attention), best of NUM_REPEATS after NUM_WARMUP runs.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionInputs
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
NUM_WARMUP, NUM_REPEATS = 2, 10


def make_inputs(seqs: list[tuple[int, int]], num_decodes: int, device: str) -> AttentionInputs:
    """(context_len, query_len) per sequence, over shuffled blocks."""
    seq_lens = [c + n for c, n in seqs]
    blocks = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    ids = torch.randperm(sum(blocks)).tolist()
    tables, slots = [], []
    for (context_len, _), seq_len, n in zip(seqs, seq_lens, blocks):
        table, ids = ids[:n], ids[n:]
        tables.append(table + [0] * (max(blocks) - n))
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context_len, seq_len)]
    query_lens = [n for _, n in seqs]
    return AttentionInputs(
        num_decodes=num_decodes,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        block_size=BLOCK_SIZE,
    )


def naive_forward(q, k, v, kv: KVCacheStorage, inputs: AttentionInputs, scale: float) -> torch.Tensor:
    """The loop TorchRefBackend replaces: per sequence, gather its blocks, repeat KV heads, one SDPA call."""
    kv.write(0, inputs.slot_mapping, k, v)
    group, outs, row = NUM_HEADS // NUM_KV_HEADS, [], 0
    layer_kv = kv.layer(0)
    for i, (query_len, seq_len) in enumerate(zip(inputs.query_lens_list, inputs.seq_lens_list)):
        blocks = inputs.block_tables[i, : math.ceil(seq_len / BLOCK_SIZE)].long()
        keys, values = (c[blocks].flatten(0, 1)[:seq_len].transpose(0, 1).repeat_interleave(group, 0)
                        for c in (layer_kv.k, layer_kv.v))
        mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - query_len)
        outs.append(F.scaled_dot_product_attention(
            q[row : row + query_len].transpose(0, 1), keys, values, attn_mask=mask, scale=scale
        ).transpose(0, 1))
        row += query_len
    return torch.cat(outs)


def best_ms(fn: Callable[[], object], device: str) -> float:
    times = []
    for i in range(NUM_WARMUP + NUM_REPEATS):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= NUM_WARMUP:
            times.append(time.perf_counter() - start)
    return min(times) * 1e3


def run_case(name: str, seqs: list[tuple[int, int]], num_decodes: int, dtype: torch.dtype, device: str) -> None:
    inputs = make_inputs(seqs, num_decodes, device)
    num_blocks = int(inputs.block_tables.max()) + 1
    kv = KVCacheStorage(KVCacheSpec(1, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype), num_blocks, device)
    kv.write(0, torch.arange(kv.num_slots, device=device),
             *(torch.randn(kv.num_slots, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in "kv"))
    T = inputs.num_tokens
    q = torch.randn(T, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k, v = (torch.randn(T, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    scale = HEAD_DIM**-0.5
    backend = TorchRefBackend()
    meta = backend.build_metadata(inputs, {None})
    batched = lambda: backend.forward(q, k, v, 0, kv, meta, scale=scale)  # noqa: E731
    torch.testing.assert_close(batched(), naive_forward(q, k, v, kv, inputs, scale), atol=2e-2, rtol=2e-2)
    fresh = TorchRefBackend()  # no workspace reuse: every layer allocates its gather buffers
    fresh._buffer = lambda numel, dt, dev: torch.empty(numel, dtype=dt, device=dev)  # type: ignore[method-assign]
    times = {
        "build_metadata": best_ms(lambda: backend.build_metadata(inputs, {None}), device),
        "torch_ref": best_ms(batched, device),
        "torch_ref_no_workspace": best_ms(lambda: fresh.forward(q, k, v, 0, kv, meta, scale=scale), device),
        "naive_loop": best_ms(lambda: naive_forward(q, k, v, kv, inputs, scale), device),
    }
    cols = "  ".join(f"{key} {ms:7.2f} ms" for key, ms in times.items())
    print(f"{name:28s} {str(dtype).removeprefix('torch.'):9s} {cols}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    decodes = [(int(c), 1) for c in torch.randint(350, 451, (64,))]
    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__}")
    for dtype in (torch.float32, torch.bfloat16):
        run_case("64 decodes", decodes, 64, dtype, args.device)
        run_case("64 decodes + 2x256 prefill", decodes + [(0, 256), (544, 256)], 64, dtype, args.device)


if __name__ == "__main__":
    main()
