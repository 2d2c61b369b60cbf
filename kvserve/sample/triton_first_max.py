"""Each row's first maximum on CUDA in two short Triton launches: ``argmax.first_max`` for CUDA rows.

torch's ``max(dim=-1)`` on one row of Llama-3's 128,256 logits took 27 us of a 5 ms decode step on an H200 (the
profile in docs/results/session15-h200). One program walking a row would wait out a memory round trip per tile, 60
of them; here the row is cut into up to ``MAX_PARTS`` parts of whole tiles, one program each (a tile or two of
reading), each part's largest value and its first index are written out, and one program per row merges its parts.
In both, each lane keeps the largest value it has seen and where, and one reduction across the lanes picks the
largest and, among equal ones, the first: a NaN counts as the largest (the first NaN wins), as in torch. Any model
dtype; the comparisons are exact in fp32. On CPU only under Triton's interpreter, which is how CI tests it against
``argmax.reference_first_max``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.triton_launch import enter_chain, pdl_options

BLOCK = 2048  # values a program reads at a time: 16 bytes a thread a load at 4 warps of fp32
MAX_PARTS = 64  # parts of a row: Llama-3's 128,256 logits are 63 programs of one tile each


@triton.jit
def _first_of(best, where, past):
    """The largest of a block of lanes' values ``best`` (a NaN the largest) and the first index ``where`` it was
    found at, ``past`` where a lane found nothing."""
    is_nan = best != best
    any_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    largest = tl.max(tl.where(is_nan, float("-inf"), best), 0)
    index = tl.min(tl.where(tl.where(any_nan, is_nan, best == largest), where, past), 0)
    return tl.where(any_nan, float("nan"), largest), index


@triton.jit
def first_max_parts_kernel(x, part_values, part_index, V, stride_row, part_len, num_parts, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    """Program (row, part): the largest of x[row, part * part_len :][: part_len] (a multiple of BLOCK) and the
    index of its first place, into part_values / part_index [rows, num_parts]."""
    enter_chain(PDL)
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    start = x + row * stride_row
    offs = tl.arange(0, BLOCK)
    first, stop = part * part_len, tl.minimum(part * part_len + part_len, V)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    where = tl.full((BLOCK,), V, tl.int32)
    for k0 in range(first, stop, BLOCK):
        idx = k0 + offs
        v = tl.load(start + idx, mask=idx < stop, other=float("-inf")).to(tl.float32)
        # a lane takes a larger value, a first NaN, or any real value first; later equal ones keep the first index
        take = (v > best) | ((v != v) & (best == best)) | ((where == V) & (idx < stop))
        best = tl.where(take, v, best)
        where = tl.where(take, idx, where)
    value, index = _first_of(best, where, V)
    tl.store(part_values + row * num_parts + part, value)
    tl.store(part_index + row * num_parts + part, index)


@triton.jit
def first_max_merge_kernel(part_values, part_index, out, num_parts, V, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """Program per row: the first maximum over its parts (in order, so the first of equal parts' maxima is the
    first place)."""
    enter_chain(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_P)
    mask = offs < num_parts
    best = tl.load(part_values + row * num_parts + offs, mask=mask, other=float("-inf"))
    where = tl.load(part_index + row * num_parts + offs, mask=mask, other=V)
    _, index = _first_of(best, where, V)
    tl.store(out + row, index.to(tl.int64))


def triton_first_max(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The int64 index of each row's first maximum of float ``x`` [..., V] (V >= 1; values contiguous), read
    ``block`` values at a time (a power of two)."""
    if not x.dtype.is_floating_point or x.dim() < 1 or not x.shape[-1] or x.stride(-1) != 1:
        raise ValueError(f"first max: a float tensor with values contiguous along a non-empty last dimension, "
                         f"not {x.dtype} of shape {tuple(x.shape)} and strides {x.stride()}")
    rows = x.reshape(-1, x.shape[-1])
    num_rows, vocab = rows.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows:
        tiles = triton.cdiv(vocab, block)
        part_len = triton.cdiv(tiles, min(tiles, MAX_PARTS)) * block
        num_parts = triton.cdiv(vocab, part_len)
        values = torch.empty(num_rows, num_parts, dtype=torch.float32, device=x.device)
        index = torch.empty(num_rows, num_parts, dtype=torch.int32, device=x.device)
        pdl = pdl_options(x.device)
        first_max_parts_kernel[(num_rows, num_parts)](rows, values, index, vocab, rows.stride(0), part_len, num_parts,
                                                      BLOCK=block, **pdl)
        first_max_merge_kernel[(num_rows,)](values, index, out, num_parts, vocab,
                                            BLOCK_P=triton.next_power_of_2(num_parts), **pdl)
    return out.view(x.shape[:-1])
