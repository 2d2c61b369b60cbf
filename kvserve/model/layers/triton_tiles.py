"""What the Triton GEMMs (``triton_ggml``, ``triton_weight_only``, ``triton_skinny``) and elementwise kernels
share: integer codes to fp32 without a conversion instruction, weight-only codes to their values, a tile's
product with weight values built in fp32 registers, the tile's epilogue, the gated MLP's activation (in
``act_and_mul``'s kernel, and folded into the loads of the down projection's input), and the timing behind
autotuning and behind a linear method's measured choice between two kernels."""

from __future__ import annotations

import logging
from typing import Callable

import torch
import triton
import triton.language as tl
import triton.testing
from triton.errors import TritonError

logger = logging.getLogger(__name__)

NO_ACTIVATION = -1  # a GEMM's x as loaded, not [gate | up]


@triton.jit
def gated_activation(gate, up, ACT: tl.constexpr):
    """``act(gate) * up`` in fp32 of fp32 tiles: ACT 0 is SiLU, 1 GELU's tanh approximation (tanh(z) written as
    2 sigmoid(2z) - 1)."""
    if ACT == 0:
        act = gate * tl.sigmoid(gate)
    else:
        inner = gate + 0.044715 * gate * gate * gate
        act = gate * tl.sigmoid(inner * 1.5957691216057308)  # 2 sqrt(2 / pi)
    return act * up


@triton.jit
def load_input_tile(x_rows, offs_k, mask_m, K, ACT: tl.constexpr):
    """x's [BLOCK_M, BLOCK_K] tile of inputs ``offs_k`` in x's dtype. With an activation (``ACT`` >= 0) each row
    of x is a gated MLP's [gate | up] (2K values) and the tile is ``act(gate) * up``, computed in fp32 and rounded
    to x's dtype as ``act_and_mul`` stores it: the down projection then needs no launch of its own for it."""
    mask = mask_m[:, None] & (offs_k < K)[None, :]
    if ACT < 0:  # NO_ACTIVATION (a module global is not a constexpr to the compiler)
        return tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0)
    gate = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0)
    up = tl.load(x_rows + K + offs_k[None, :], mask=mask, other=0.0)
    return gated_activation(gate.to(tl.float32), up.to(tl.float32), ACT).to(gate.dtype)


@triton.jit
def exact_float(q):
    """Integer codes -128..255 as fp32, by their bits: 2^23 + 128 + q is an fp32 whose low mantissa bits are
    q + 128, and subtracting 2^23 + 128 is exact. The programming guide's throughput table lists 16 type
    conversions a clock per multiprocessor on compute capability 9.0, against 64 integer and 128 fp32 operations,
    and a decode step converts every code it reads (``benchmarks/triton_weight_only.py`` and ``triton_ggml.py``
    measure the kernels)."""
    return ((q.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def code_values(code_rows, param_rows, scales, offsets, k0, mask_n, K, group_size, INT4: tl.constexpr,
                 HAS_OFFSET: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 values [BLOCK_N, BLOCK_K] of a weight-only weight's inputs k0 .. k0 + BLOCK_K (one group) of the
    rows at ``code_rows`` (``weight_quant.PackedWeight``'s layout): ``code * scale (+ offset)``, the product exact,
    one rounding."""
    if INT4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(code_rows + offs_b[None, :], mask=mask_n[:, None] & (offs_b < K // 2)[None, :],
                         other=0).to(tl.int32)
        q = tl.interleave(packed & 15, packed >> 4)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(code_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :], other=0)
    group = k0 // group_size
    values = exact_float(q) * tl.load(scales + param_rows + group, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    if HAS_OFFSET:
        values += tl.load(offsets + param_rows + group, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    return values


@triton.jit
def accumulate_dot(acc, xs, values):
    """``acc + xs @ values.T`` for x's [BLOCK_M, BLOCK_K] tile and fp32 weight values [BLOCK_N, BLOCK_K]: IEEE fp32
    for fp32 x, else the values cast to x's dtype (tensor cores), fp32 accumulation either way."""
    if xs.dtype == tl.float32:
        acc += tl.dot(xs, tl.trans(values), input_precision="ieee")
    else:
        acc += tl.dot(xs, tl.trans(values.to(xs.dtype)))
    return acc


@triton.jit
def store_tile(y, acc, bias, offs_m, offs_n, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """y[offs_m, offs_n] = acc (+ bias[offs_n]) in y's dtype, within [M, N]."""
    mask_m, mask_n = offs_m < M, offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def configs_within_a_group(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    """An autotuner's ``early_config_prune`` for kernels over weight-only codes: a tile of codes lies in one group,
    so configs whose BLOCK_K does not divide the group size go (a row of one group, INT8's, takes any)."""
    group, k = named_args["group_size"], named_args["K"]
    return [c for c in configs if group % c.kwargs["BLOCK_K"] == 0 or group >= k]


def tuning_bench(kernel_call: Callable[[], object], quantiles: tuple[float, ...]) -> list[float]:
    """An autotuner's timing of one config: a few ms (Triton's default spends 125), since a model's layer shapes
    are tuned at start-up."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def median_ms(call: Callable[[], object]) -> float:
    """A call's median time on CUDA (``do_bench`` empties the L2 before each call, as a step finds it): what a
    linear method's measured choice between two kernels compares."""
    return triton.testing.do_bench(call, warmup=5, rep=20, return_mode="median")


class MeasuredChoices:
    """A linear method's choices between two ways of computing a step, each made once per key (a layer shape and
    batch size class, say) by timing both at the key's first step: ``median_ms`` on CUDA, ``timer`` where one is
    given; elsewhere, with none, ``default`` (under the interpreter nothing is worth timing). A candidate that
    fails to compile or run is not chosen (with a warning): it is an optional faster way. The engine's eager
    warm-up makes the choices before any CUDA graph is captured."""

    def __init__(self, name: str, default: bool, timer: Callable[[Callable[[], object]], float] | None = None
                 ) -> None:
        """``name``: what the candidate is, in reports of the choices made (``gpu_decode_step.py``)."""
        self.name, self.default, self.timer = name, default, timer
        self.made: dict[tuple, bool] = {}

    def __call__(self, key: tuple, candidate: Callable[[], object], baseline: Callable[[], object],
                 device: torch.device) -> bool:
        """Whether ``candidate`` timed faster than ``baseline`` the first time ``key`` came."""
        if key not in self.made:
            timer = self.timer or (median_ms if device.type == "cuda" else None)
            self.made[key] = self.default if timer is None else self._timed(key, candidate, baseline, timer)
        return self.made[key]

    def _timed(self, key: tuple, candidate: Callable[[], object], baseline: Callable[[], object],
               timer: Callable[[Callable[[], object]], float]) -> bool:
        baseline()  # compiled before it is timed; it is what every step runs where the candidate cannot
        try:
            candidate()  # compiled and tuned before either is timed
            return timer(candidate) < timer(baseline)
        except (TritonError, RuntimeError, ValueError) as error:  # the compiler's or the device's refusal
            logger.warning("%s for %s failed to run or time, the other way serves it: %s", self.name, key, error)
            return False
