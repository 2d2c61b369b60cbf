"""Weight-only INT8 / INT4 on CUDA (``--quantization int8|int4``): ``weight_quant``'s codes laid out for a GPU, and
a Triton kernel that multiplies fp16 / bf16 (or fp32) activations by them.

The quantization is the CPU's (``weight_quant.quantize_rows``: INT8 symmetric per output channel; INT4 in groups
of 128 inputs, each with an fp16 scale and minimum), so a model's dequantized weights are the same values on
both devices. Only the layout differs (``weight_quant.PackedWeight``): the codes one [N, K] int8 matrix, or
[N, K / 2] bytes for INT4 (value 2j in the low nibble of byte j, 2j + 1 in the high one), and the scales and
minimums [N, groups] fp16 matrices of their own.

A program computes a [BLOCK_M, BLOCK_N] tile of ``y = x @ W.T``. Its k loop loads x's [BLOCK_M, BLOCK_K] tile
and the codes of its BLOCK_N weight rows, builds their values in fp32 (``code * scale + minimum``: the product
is exact, so one rounding, as in the twin), casts them to x's dtype and accumulates the tile's product in fp32
(tensor cores for fp16 / bf16; IEEE fp32 otherwise). BLOCK_K divides the group size, so a tile needs one scale
per row. A step reads 4.25 bits a weight (INT4 with its parameters) or 8 (INT8) where bf16 reads 16: what
bounds a decode step at small batch.

On CUDA the tile shapes are tuned per layer shape and batch size class at a layer's first call (the engine's
eager warm-up, before any graph is captured); under Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs
it) one fixed shape runs. A step of many rows may instead write the weight out once (``dequantize_kernel``) for
torch's GEMM, where that measured faster, and a step of up to 4 rows may take ``triton_skinny``'s kernel on
the same codes (``TritonWeightOnlyLinearMethod``). The twin is ``reference_linear``: the dequantized weight, then
``F.linear``.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvserve.model.layers.linear import AsLoadedLinearMethod, Linear, linear_into
from kvserve.model.layers.triton_skinny import SkinnySteps, skinny_gemm
from kvserve.model.layers.triton_tiles import (
    NO_ACTIVATION, MeasuredChoices, accumulate_dot, code_values, configs_within_a_group, store_tile, tuning_bench,
)
from kvserve.model.layers.weight_quant import PackedWeight, QuantizedRows, quantize_rows
from kvserve.triton_launch import enter_chain, pdl_options

# tile shapes tried per (N, K, batch class) on CUDA. A decode-sized batch is bound by reading the codes: narrow
# programs along N spread them over every multiprocessor (Llama-3-8B's o projection, N = 4096, is 256 programs
# of 16 rows), and deep software pipelines keep several tiles in flight in each (compiled for sm_90, a stage of
# 32 rows x 128 INT4 codes is one 16-byte cp.async a thread). Larger batches want wider tiles.
DECODE_CONFIGS = [
    triton.Config({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k}, num_warps=4, num_stages=s)
    for n in (16, 32, 64) for k in (64, 128) for s in (4, 8)
]
BATCH_CONFIGS = [
    triton.Config({"BLOCK_M": m, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=w, num_stages=3)
    for m in (64, 128) for w in (4, 8)
]
INTERPRETED_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}
DECODE_ROWS = 16  # steps of up to this many rows always take the packed kernel: reading the codes bounds them


@triton.jit
def weight_only_gemm_kernel(x, codes, scales, offsets, bias, y, M, N, K, stride_xm, stride_codes, stride_scales,
                            stride_ym, group_size, INT4: tl.constexpr, HAS_OFFSET: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y [M, N] = x [M, K] @ W.T (+ bias), W = codes * scales (+ offsets) per group of ``group_size`` inputs
    (a multiple of BLOCK_K). Program (n tile, m tile)."""
    enter_chain(PDL)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = x + offs_m.to(tl.int64)[:, None] * stride_xm
    code_rows = codes + offs_n.to(tl.int64)[:, None] * stride_codes
    param_rows = offs_n.to(tl.int64) * stride_scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        values = code_values(code_rows, param_rows, scales, offsets, k0, mask_n, K, group_size, INT4, HAS_OFFSET,
                              BLOCK_K)
        acc = accumulate_dot(acc, xs, values)
    store_tile(y, acc, bias, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


@triton.jit
def dequantize_kernel(codes, scales, offsets, out, N, K, stride_codes, stride_scales, stride_out, group_size,
                      INT4: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    """out [N, K] = W in out's dtype (each value rounded once from its exact fp32). Program (n tile, k tile)."""
    enter_chain(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    values = code_values(codes + offs_n.to(tl.int64)[:, None] * stride_codes, offs_n.to(tl.int64) * stride_scales,
                          scales, offsets, k0, mask_n, K, group_size, INT4, HAS_OFFSET, BLOCK_K)
    out_ptrs = out + offs_n.to(tl.int64)[:, None] * stride_out + offs_k[None, :]
    tl.store(out_ptrs, values.to(out.dtype.element_ty), mask=mask_n[:, None] & (offs_k < K)[None, :])


@functools.cache
def _tuned(batch: bool) -> triton.runtime.autotuner.Autotuner:
    """The kernel tuned over ``BATCH_CONFIGS`` or ``DECODE_CONFIGS`` per layer shape (CUDA only: tuning times
    launches), configs whose tiles would straddle a group pruned."""
    return triton.autotune(BATCH_CONFIGS if batch else DECODE_CONFIGS, key=["N", "K", "INT4"],
                           prune_configs_by={"early_config_prune": configs_within_a_group}, do_bench=tuning_bench)(
        weight_only_gemm_kernel)


def weight_only_gemm(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` in x's dtype, into ``out`` [M, N] (its rows may be strided) if given."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or (weight.group_size % 64 and weight.group_size < k):
        raise ValueError(f"weight-only GEMM: x {tuple(x.shape)} does not fit a weight of shape {weight.shape} "
                         f"in groups of {weight.group_size}")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device) if out is None else out
    if not x.shape[0]:
        return y
    args = (x, weight.codes, weight.scale, weight.scale if weight.offset is None else weight.offset,
            x if bias is None else bias, y, x.shape[0], n, k, x.stride(0), weight.codes.stride(0),
            weight.scale.stride(0), y.stride(0), weight.group_size)
    flags = {"INT4": weight.int4, "HAS_OFFSET": weight.offset is not None, "HAS_BIAS": bias is not None,
             **pdl_options(x.device)}
    if x.device.type == "cuda":
        kernel = _tuned(batch=x.shape[0] > 16)
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(x.shape[0], meta["BLOCK_M"]))](
            *args, **flags)
    else:  # the interpreter
        config = INTERPRETED_CONFIG
        grid = (triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(x.shape[0], config["BLOCK_M"]))
        weight_only_gemm_kernel[grid](*args, **flags, **config)
    return y


def dequantize(weight: PackedWeight, out: torch.Tensor) -> torch.Tensor:
    """The weight's values in ``out``'s dtype, into ``out`` [N, K] (rows contiguous): for a batch large enough that
    torch's GEMM on them beats the packed kernel (``TritonWeightOnlyLinearMethod``)."""
    n, k = weight.shape
    if out.shape != (n, k) or out.stride(1) != 1:
        raise ValueError(f"dequantize: out {tuple(out.shape)} is not rows of [{n}, {k}]")
    block_k = 64 if weight.group_size % 64 == 0 or weight.group_size >= k else 32  # a tile lies in one group
    dequantize_kernel[(triton.cdiv(n, 32), triton.cdiv(k, block_k))](
        weight.codes, weight.scale, weight.scale if weight.offset is None else weight.offset, out, n, k,
        weight.codes.stride(0), weight.scale.stride(0), out.stride(0), weight.group_size, INT4=weight.int4,
        HAS_OFFSET=weight.offset is not None, BLOCK_N=32, BLOCK_K=block_k, **pdl_options(out.device))
    return out


def reference_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The twin of ``weight_only_gemm``: the dequantized weight in x's dtype, then ``F.linear``."""
    return F.linear(x, weight.dequantize().to(x.dtype), bias)


class TritonWeightOnlyLinearMethod(SkinnySteps, AsLoadedLinearMethod):
    """Quantizes each linear layer's weight as it loads (``scheme`` "int8" or "int4"), on the layer's device, into
    one ``PackedWeight`` (a packed layer's projections joined: one launch a step, where a launch costs as much as
    reading a small projection). Steps of up to ``DECODE_ROWS`` rows multiply the codes with
    ``weight_only_gemm``, or those of up to 4 with the skinny kernel where it timed faster (``SkinnySteps``: its
    fp32 products need no conversion of the values to the tensor cores' dtype, and a gated MLP's activation can
    fold into the down projection's loads); a larger one takes whichever measured faster the first time a step
    of its layer shape and batch size class (a power of two) came: the packed kernel, or the weight dequantized
    into a scratch matrix and torch's GEMM (a prefill's many rows make the GEMM compute-bound, where the packed
    kernel's decoding of every tile costs more than writing the weight out once). A tied LM head keeps the
    embeddings' weight as loaded (``F.linear``)."""

    def __init__(self, scheme: str, timer: Callable[[Callable[[], object]], float] | None = None) -> None:
        """``timer``: a call's time, for the choices (default: ``median_ms`` on CUDA; elsewhere, with none, the
        skinny kernel where it can, and the packed kernel over the dequantized GEMM)."""
        self.scheme = scheme
        self.skinny = MeasuredChoices("skinny", default=True, timer=timer)
        self.dequantized_gemm = MeasuredChoices("dequantized GEMM", default=False, timer=timer)
        self.largest = 0  # values of the largest packed weight: the scratch's size, fixed once loading is done
        self._scratch: torch.Tensor | None = None  # one for every layer; CUDA graphs hold its address

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        if name == "weight":
            tensor = quantize_rows(tensor.dequantize().to(layer.weight.device), self.scheme)
        super().load_weight(layer, name, tensor, shard)

    def process_weights_after_loading(self, layer: Linear) -> None:
        parts = self.loaded_parts(layer)
        if not parts:
            layer.packed_parts = None
            return
        joined = QuantizedRows(*(None if parts[0][i] is None else torch.cat([part[i] for part in parts])
                                 for i in range(3)), parts[0].group_size)
        layer.packed_parts = (PackedWeight.of(joined),)
        self.largest = max(self.largest, joined.codes.numel())

    def skinny_weight(self, layer: Linear) -> PackedWeight | None:
        return None if layer.packed_parts is None else layer.packed_parts[0]

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed_parts is None:  # a tied head: the embeddings' weight
            return linear_into(x, layer.weight, layer.bias)
        weight, rows = layer.packed_parts[0], x.reshape(-1, layer.in_features)
        if rows.shape[0] > DECODE_ROWS and self._dequantizes(weight, rows, layer.bias):
            y = F.linear(rows, self._dequantized(weight, rows), layer.bias)
        elif self.takes_skinny(layer, rows, NO_ACTIVATION, lambda: weight_only_gemm(rows, weight, layer.bias)):
            y = skinny_gemm(rows, weight, layer.bias)
        else:
            y = weight_only_gemm(rows, weight, layer.bias)
        return y.view(*x.shape[:-1], layer.out_features)

    def _dequantized(self, weight: PackedWeight, x: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        if self._scratch is None or self._scratch.dtype != x.dtype or self._scratch.device != x.device:
            self._scratch = torch.empty(self.largest, dtype=x.dtype, device=x.device)
        return dequantize(weight, self._scratch[: n * k].view(n, k))

    def _dequantizes(self, weight: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether a step of ``x``'s rows takes the dequantized GEMM: measured at the first step of its class
        (both ways, a few ms each on CUDA), the packed kernel where nothing times them."""
        def dequantized() -> torch.Tensor:  # the name tells a test's timer which call this is
            return F.linear(x, self._dequantized(weight, x), bias)

        key = (*weight.shape, weight.int4, x.dtype, triton.next_power_of_2(x.shape[0]))
        return self.dequantized_gemm(key, dequantized, lambda: weight_only_gemm(x, weight, bias), x.device)
