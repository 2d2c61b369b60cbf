"""A Triton GEMM for the few rows of a decode step on CUDA (``skinny_gemm``), over dense weights
(``TritonSkinnyLinearMethod``, CUDA's method for them) or weight-only INT8 / INT4 codes (taken by
``triton_weight_only``), which can take a gated MLP's activation into its loads.

At one to four rows a step's GEMMs read every weight once: cuBLAS reads Llama-3-8B's projections at 3.1-4.0 TB/s on
an H200 (the profile in docs/results/session15-h200), but for the two whose outputs are narrow (o and down, N =
4,096) it splits K and runs a second kernel to add the splits (64 launches a step), and the gated MLP's ``act(gate)
* up`` is a launch of its own between gate_up and down (32 more). Inside a CUDA graph each short launch costs its ~2
us plus a ~2 us gap. ``skinny_gemm_kernel`` gives each program ``BLOCK_N`` output columns over the whole of K (no
split, nothing to add), with the rows of x (one to four) in its registers; for the down projection it loads x as the
MLP's packed [gate | up] and computes the activation's product as it goes (``triton_tiles.load_input_tile``): a
row's product costs a few SFU operations per input per program, a fraction of the load of the weights. On codes it
builds each weight value in fp32 (``code * scale + offset``, one FMA after the integer-to-float bits) and multiplies
it at once: no conversion to the tensor cores' dtype (16 a clock per multiprocessor in the programming guide's table
for compute capability 9.0, against 128 FMAs).

Products are fp32 multiplies summed in fp32 (no tensor cores: at these rows they would compute 16 rows to keep one).
The twin is ``F.linear`` on the same weight (after ``act_and_mul`` for the gated form; on the dequantized weight for
codes): they differ in the order of the sums, and for fp16 / bf16 in the rounding of the output (and of the weight
values, which the twin rounds to the dtype). Whether a layer's shape, at a batch size class, takes this kernel or
the method's own GEMM (with the activation's own launch) is measured at its first step (``SkinnySteps``), in the
engine's eager warm-up before graphs are captured: cuBLAS keeps whatever it reads faster
(docs/results/session15-h200 has it level with a Triton kernel of this kind on the wide projections, gate_up and the
LM head). Under Triton's interpreter (CI) the kernel always runs, at one fixed tile shape.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvserve.model.layers.activation import KERNEL_ACTIVATIONS
from kvserve.model.layers.linear import Linear, UnquantizedLinearMethod
from kvserve.model.layers.triton_tiles import (
    NO_ACTIVATION, MeasuredChoices, code_values, configs_within_a_group, load_input_tile, store_tile, tuning_bench,
)
from kvserve.model.layers.weight_quant import PackedWeight
from kvserve.triton_launch import enter_chain, pdl_options

SKINNY_ROWS = 4  # steps of up to this many rows may take the kernel: x's rows then fit in registers


def _configs(*shapes: tuple[int, int, int]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=4, num_stages=s) for n, k, s in shapes]


# tile shapes tried per rows class (1, 2, 4): a program's [rows, BLOCK_N, BLOCK_K] products are fp32 registers,
# 4,096-8,192 of them (32-64 a thread, compiled for sm_90: 74-150 registers, nothing spilled); narrow tiles give
# Llama-3-8B's o and down projections (N = 4,096) 64-512 programs for the 132 multiprocessors
CONFIGS = {
    1: _configs((8, 512, 3), (16, 256, 3), (32, 128, 4), (32, 256, 3), (64, 128, 3)),
    2: _configs((8, 256, 3), (16, 256, 3), (32, 128, 3)),
    4: _configs((8, 256, 3), (16, 128, 4), (8, 128, 4)),
}
INTERPRETED_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 32}


@triton.jit
def skinny_gemm_kernel(x, w, scales, offsets, bias, y, M, N, K, stride_xm, stride_wn, stride_scales, stride_ym,
                       group_size, CODES: tl.constexpr, INT4: tl.constexpr, HAS_OFFSET: tl.constexpr,
                       ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y [M, N] = x [M, K] @ W.T (+ bias), M <= BLOCK_M; W is ``w`` itself, or with ``CODES`` a weight-only
    weight's codes (``PackedWeight``: ``w`` the codes, their ``scales`` and ``offsets`` per group of
    ``group_size`` inputs, a multiple of BLOCK_K), each value built in fp32 (``code_values``). With ``ACT`` >= 0
    x's rows are [gate | up] (2K values) and the product is ``(act(gate) * up) @ W.T``. Program: BLOCK_N columns
    over all of K, the products of each k tile summed at the end."""
    enter_chain(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = x + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xs = load_input_tile(x_rows, offs_k, mask_m, K, ACT).to(tl.float32)
        if CODES:
            ws = code_values(w_rows, offs_n.to(tl.int64) * stride_scales, scales, offsets, k0, mask_n, K, group_size,
                             INT4, HAS_OFFSET, BLOCK_K)
        else:
            ws = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)
        acc += xs[:, None, :] * ws.to(tl.float32)[None, :, :]
    store_tile(y, tl.sum(acc, axis=2), bias, offs_m, offs_n, M, N, stride_ym, HAS_BIAS)


@functools.cache
def _tuned(rows_class: int) -> triton.runtime.autotuner.Autotuner:
    """The kernel tuned over ``CONFIGS[rows_class]`` per layer shape and weight format (CUDA only: tuning times
    launches), configs whose tiles of codes would straddle a group pruned."""
    return triton.autotune(CONFIGS[rows_class], key=["N", "K", "ACT", "CODES", "INT4"], do_bench=tuning_bench,
                           prune_configs_by={"early_config_prune": configs_within_a_group})(skinny_gemm_kernel)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None,
                activation: int = NO_ACTIVATION) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` in x's dtype for M <= SKINNY_ROWS, W a dense ``weight`` (rows contiguous) or a
    weight-only one's codes (``PackedWeight``, groups a multiple of 128 or the whole row); with an ``activation``
    (the kernels' enum, ``KERNEL_ACTIVATIONS``) x is [M, 2K], a gated MLP's [gate | up], and its product is
    multiplied."""
    codes = isinstance(weight, PackedWeight)
    w = weight.codes if codes else weight
    n, k = weight.shape
    width = k if activation == NO_ACTIVATION else 2 * k
    group = weight.group_size if codes else k
    if (x.dim() != 2 or x.shape[1] != width or x.shape[0] > SKINNY_ROWS or w.stride(1) != 1
            or group < k and group % 128):
        raise ValueError(f"skinny GEMM: x {tuple(x.shape)} (at most {SKINNY_ROWS} rows of {width}) does not fit a "
                         f"weight of shape {tuple(weight.shape)} with contiguous rows"
                         + (f" in groups of {group}" if codes else ""))
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if not x.shape[0]:
        return y
    scales = weight.scale if codes else w  # (unread without codes)
    offsets = weight.offset if codes and weight.offset is not None else scales
    args = (x, w, scales, offsets, x if bias is None else bias, y, x.shape[0], n, k, x.stride(0), w.stride(0),
            scales.stride(0) if codes else 0, y.stride(0), group)
    rows_class = triton.next_power_of_2(x.shape[0])
    flags = {"CODES": codes, "INT4": codes and weight.int4, "HAS_OFFSET": codes and weight.offset is not None,
             "ACT": activation, "HAS_BIAS": bias is not None, "BLOCK_M": rows_class, **pdl_options(x.device)}
    if x.device.type == "cuda":
        _tuned(rows_class)[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    else:  # the interpreter
        skinny_gemm_kernel[(triton.cdiv(n, INTERPRETED_CONFIG["BLOCK_N"]),)](*args, **flags, **INTERPRETED_CONFIG)
    return y


class SkinnySteps(ABC):
    """What a linear method whose weight the skinny kernel reads adds to it: steps of up to ``SKINNY_ROWS`` rows
    take ``skinny_gemm`` where that timed faster than the method's own product (``skinny``, a
    ``MeasuredChoices`` keyed by layer shape, activation, dtype and power-of-two rows class), and a gated MLP's
    down projection folds the activation into the kernel's loads where that timed faster than ``act_and_mul``
    followed by the method's ``apply``. A method defines ``skinny_weight``."""

    skinny: MeasuredChoices

    @abstractmethod
    def skinny_weight(self, layer: Linear) -> torch.Tensor | PackedWeight | None:
        """The weight as the kernel reads it, or None where the kernel does not take the layer."""

    def apply_gated(self, layer: Linear, gate_up: torch.Tensor, activation: str,
                    act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        code = KERNEL_ACTIVATIONS.get(activation)
        rows = gate_up.reshape(-1, 2 * layer.in_features)
        if code is not None and self.takes_skinny(layer, rows, code, lambda: self.apply(layer, act_and_mul(rows))):
            y = skinny_gemm(rows, self.skinny_weight(layer), layer.bias, code)
            return y.view(*gate_up.shape[:-1], layer.out_features)
        return self.apply(layer, act_and_mul(gate_up))

    def takes_skinny(self, layer: Linear, rows: torch.Tensor, activation: int, other: Callable[[], object]) -> bool:
        """Whether these rows take ``skinny_gemm``: measured against ``other`` (the method's product of them) at
        the first step of their class."""
        weight = self.skinny_weight(layer)
        if weight is None or not 0 < rows.shape[0] <= SKINNY_ROWS:
            return False

        def skinny() -> torch.Tensor:  # the name tells a test's timer which call this is
            return skinny_gemm(rows, weight, layer.bias, activation)

        key = (*weight.shape, activation, rows.dtype, triton.next_power_of_2(rows.shape[0]))
        return self.skinny(key, skinny, other, rows.device)


class TritonSkinnyLinearMethod(SkinnySteps, UnquantizedLinearMethod):
    """The checkpoint's weight, multiplied by ``F.linear``, or by ``skinny_gemm`` for the steps ``SkinnySteps``
    gives it."""

    def __init__(self, timer: Callable[[Callable[[], object]], float] | None = None) -> None:
        """``timer``: a call's time, for the choices (default: ``median_ms`` on CUDA; elsewhere, with none, the
        kernel is always taken)."""
        self.skinny = MeasuredChoices("skinny", default=True, timer=timer)

    def skinny_weight(self, layer: Linear) -> torch.Tensor | None:
        return layer.weight if layer.weight.stride(1) == 1 else None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        if self.takes_skinny(layer, rows, NO_ACTIVATION, lambda: F.linear(rows, layer.weight, layer.bias)):
            return skinny_gemm(rows, layer.weight, layer.bias).view(*x.shape[:-1], layer.out_features)
        return F.linear(x, layer.weight, layer.bias)
