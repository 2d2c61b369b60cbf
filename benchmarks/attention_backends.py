"""One layer of each CPU attention backend on the issue-6 and issue-21 shapes, in the same run.

    python benchmarks/attention_backends.py [--threads N] [--only SUBSTRING]

Shapes: SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) and Gemma-3-270M's sliding layers (4 query
heads, 1 KV head, head_dim 256, window 512), block_size 16, shuffled block tables, fp32. Cases: 32 decodes at
contexts 380..500 (mean ~440); prefill chunks of 512 tokens on 0 / 512 / 1,400 cached tokens, four chunks of
128, 32 queries on 1,024 cached; and the decodes with a fresh chunk in one step. The cache has NUM_LAYERS
layers (30, as SmolLM2), so a layer's K/V comes from memory as in a real step rather than from the last-level
cache that one layer's K/V would fit in. Each time is a pass of ``forward`` (KV write + attention) over every
layer, divided by NUM_LAYERS: the best of NUM_ROUNDS rounds that alternate the columns, after a warm-up pass
each. Columns: ``torch_ref`` (gather + SDPA, what chunks ran through before the prefill kernel) and
``cpu_paged`` (decodes and chunks through the C kernels, in place).
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from typing import Callable, NamedTuple

import torch

from attention_torch_ref import BLOCK_SIZE, make_inputs
from kvserve.attention.backend import AttentionBackend, AttentionInputs
from kvserve.attention.cpu_paged import CpuPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage

NUM_LAYERS = 30
NUM_ROUNDS = 8


class Shape(NamedTuple):
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None


SMOLLM2 = Shape("SmolLM2", 9, 3, 64, None)
GEMMA3 = Shape("Gemma3 sliding", 4, 1, 256, 512)


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


def layer_forward(backend: AttentionBackend, inputs: AttentionInputs, q, k, v, kv: KVCacheStorage, shape: Shape
                  ) -> Callable[[int], torch.Tensor]:
    meta = backend.build_metadata(inputs, {shape.window})
    return lambda layer: backend.forward(q, k, v, layer, kv, meta, scale=shape.head_dim**-0.5,
                                         sliding_window=shape.window)


def every_layer(forward: Callable[[int], torch.Tensor]) -> None:
    for layer in range(NUM_LAYERS):
        forward(layer)


def run_case(name: str, seqs: list[tuple[int, int]], num_decodes: int, shape: Shape = SMOLLM2) -> None:
    inputs = make_inputs(seqs, num_decodes, "cpu")
    num_kv_heads, head_dim = shape.num_kv_heads, shape.head_dim
    kv = KVCacheStorage(KVCacheSpec(NUM_LAYERS, num_kv_heads, head_dim, BLOCK_SIZE, torch.float32),
                        int(inputs.block_tables.max()) + 1, "cpu")
    slots = torch.arange(kv.num_slots)
    for layer in range(NUM_LAYERS):
        kv.write(layer, slots, *(torch.randn(kv.num_slots, num_kv_heads, head_dim) for _ in "kv"))
    q = torch.randn(inputs.num_tokens, shape.num_heads, head_dim)
    k, v = (torch.randn(inputs.num_tokens, num_kv_heads, head_dim) for _ in range(2))
    forwards = {key: layer_forward(backend, inputs, q, k, v, kv, shape)
                for key, backend in (("torch_ref", TorchRefBackend()), ("cpu_paged", CpuPagedBackend()))}
    torch.testing.assert_close(forwards["cpu_paged"](0), forwards["torch_ref"](0), atol=1e-4, rtol=1e-4)
    passes = {key: functools.partial(every_layer, forward) for key, forward in forwards.items()}
    times = {key: ms / NUM_LAYERS for key, ms in interleaved_ms(passes).items()}
    kv_mb = sum(inputs.seq_lens_list) * num_kv_heads * head_dim * 4 * 2 / 1e6
    cols = "  ".join(f"{key} {ms:6.2f} ms" for key, ms in times.items())
    print(f"{shape.name + ': ' + name:48s} K/V {kv_mb:4.1f} MB/layer  {cols}  torch_ref/cpu_paged "
          f"{times['torch_ref'] / times['cpu_paged']:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    decodes = [(int(c), 1) for c in torch.randint(380, 501, (32,))]
    cases = [("32 decodes", decodes, 32, SMOLLM2), ("32 decodes + 512-token chunk", decodes + [(0, 512)], 32, SMOLLM2)]
    for shape in (SMOLLM2, GEMMA3):
        cases += [
            ("512-token chunk, no context", [(0, 512)], 0, shape),
            ("512-token chunk after 512 cached", [(512, 512)], 0, shape),
            ("512-token chunk after 1,400 cached", [(1400, 512)], 0, shape),
            ("4 chunks of 128", [(0, 128), (200, 128), (440, 128), (700, 128)], 0, shape),
            ("32 queries after 1,024 cached", [(1024, 32)], 0, shape),
        ]
    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    for name, seqs, num_decodes, shape in cases:
        if args.only in f"{shape.name}: {name}":
            run_case(name, seqs, num_decodes, shape)


if __name__ == "__main__":
    main()
