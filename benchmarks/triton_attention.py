"""One attention layer through TritonPagedBackend and TorchRefBackend on CUDA, in the same run.

    python benchmarks/triton_attention.py [--dtype bfloat16|float16|float32] [--iters N]

Shapes: SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) and Llama-3-8B (32 / 8 / 128), block_size 16,
shuffled block tables. Cases: decode batches of 1, 8 and 64 at a 2,048-token context (batch 1 and 8 split the
keys), the 64 again with 1,024 or 1,984 of their keys in blocks all of them share (Triton's cascade attention
reads those once per tile of decodes; the GB/s column then counts every decode's keys), 256 decodes at 512, a
2,048-token prefill on no context and a 512-token chunk on 4,096 cached tokens.
Each time is one ``forward`` (KV write + attention), the median of ``--iters`` timed with CUDA events after
warm-up; decodes also give the GB/s of K/V they read (the cache's bytes of every key of the step), to set
against the HBM roofline (about 3 TB/s on an H100). Needs a GPU: on CPU it refuses (the interpreter's times
say nothing).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from attention_torch_ref import BLOCK_SIZE, make_inputs
from triton_ggml import cuda_arguments, time_ms as cuda_median_ms
from kvserve.attention.backend import AttentionBackend, AttentionInputs, shared_prefixes
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage


class Shape(NamedTuple):
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = [Shape("SmolLM2-135M", 9, 3, 64), Shape("Llama-3-8B", 32, 8, 128)]
CASES = {  # name: ((context_len, query_len) per sequence, number of decodes, leading blocks all decodes share)
    "decode x1 @2048": ([(2047, 1)], 1, 0),
    "decode x8 @2048": ([(2047, 1)] * 8, 8, 0),
    "decode x64 @2048": ([(2047, 1)] * 64, 64, 0),
    "  1,024 shared": ([(2047, 1)] * 64, 64, 1024 // BLOCK_SIZE),  # cascade attention: the same step, a prompt
    "  1,984 shared": ([(2047, 1)] * 64, 64, 1984 // BLOCK_SIZE),  # shared (a system prompt's prefix hits)
    "decode x256 @512": ([(511, 1)] * 256, 256, 0),
    "prefill 2048": ([(0, 2048)], 0, 0),
    "chunk 512 on 4096": ([(4096, 512)], 0, 0),
}


def time_ms(backend: AttentionBackend, shape: Shape, inputs: AttentionInputs, dtype: torch.dtype,
            iters: int) -> float:
    """Median milliseconds of one layer's forward (metadata built once, as a step does for every layer)."""
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in inputs.seq_lens_list)
    kv = KVCacheStorage(KVCacheSpec(1, shape.num_kv_heads, shape.head_dim, BLOCK_SIZE, dtype), num_blocks, "cuda")
    for paged in kv.layer(0).tensors():
        paged.normal_()  # never time zeros
    q = torch.randn(inputs.num_tokens, shape.num_heads, shape.head_dim, dtype=dtype, device="cuda")
    k, v = (torch.randn(inputs.num_tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype, device="cuda")
            for _ in "kv")
    meta = backend.build_metadata(inputs, {None})
    return cuda_median_ms(lambda: backend.forward(q, k, v, 0, kv, meta, scale=shape.head_dim**-0.5), iters)


def kv_bytes(shape: Shape, inputs: AttentionInputs, dtype: torch.dtype) -> int:
    return 2 * sum(inputs.seq_lens_list) * shape.num_kv_heads * shape.head_dim * dtype.itemsize


def sharing(inputs: AttentionInputs, num_blocks: int) -> AttentionInputs:
    """The decodes' first ``num_blocks`` blocks made the first decode's, with the keys they share as the runner
    gives them (``shared_prefixes``)."""
    if not num_blocks:
        return inputs
    tables = inputs.block_tables.clone()
    tables[: inputs.num_decodes, :num_blocks] = tables[0, :num_blocks]
    lens, order = shared_prefixes(tables[: inputs.num_decodes].cpu().numpy(),
                                  inputs.seq_lens[: inputs.num_decodes].cpu().numpy(), BLOCK_SIZE)
    return replace(inputs, block_tables=tables, max_shared_prefix_len=int(lens.max()),
                   shared_prefix_lens=torch.from_numpy(lens).to(tables.device),
                   sharing_order=torch.from_numpy(order).to(tables.device))


def main() -> None:
    args = cuda_arguments(__doc__.split("\n\n")[0], "triton_attention.py")
    from kvserve.attention.triton_paged import TritonPagedBackend  # imports triton

    dtype = getattr(torch, args.dtype)
    backends = {"torch_ref": TorchRefBackend(), "triton": TritonPagedBackend()}
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, block_size {BLOCK_SIZE}, median of {args.iters}")
    print(f"{'shape':<14}{'case':<20}{'torch_ref ms':>14}{'triton ms':>11}{'speed-up':>10}{'triton GB/s':>13}")
    cascades = []
    for shape in SHAPES:
        unshared_ms = None  # the triton time of the case before the shared ones: the same step, nothing shared
        for case, (seqs, num_decodes, shared_blocks) in CASES.items():
            inputs = sharing(make_inputs(seqs, num_decodes, "cuda"), shared_blocks)
            ms = {name: time_ms(b, shape, inputs, dtype, args.iters) for name, b in backends.items()}
            rate = f"{kv_bytes(shape, inputs, dtype) / ms['triton'] / 1e6:.0f}" if num_decodes else "-"
            print(f"{shape.name:<14}{case:<20}{ms['torch_ref']:>14.3f}{ms['triton']:>11.3f}"
                  f"{ms['torch_ref'] / ms['triton']:>9.1f}x{rate:>13}")
            if shared_blocks:
                cascades.append(f"cascade: {shape.name}, 64 decodes at 2,048 keys, {case.strip()}: triton "
                                f"{ms['triton']:.3f} ms against {unshared_ms:.3f} ms sharing nothing "
                                f"({unshared_ms / ms['triton']:.1f}x)")
            else:
                unshared_ms = ms["triton"]
    print("\n".join(cascades))  # gpu_summary.py picks these lines out of the log


if __name__ == "__main__":
    main()
