"""GGMLTensor: a weight kept in llama.cpp's quantized blocks as a GGUF file stores it, and the linear method that
multiplies by it without dequantizing it first (``csrc/ggml_gemm.c``).

A decode step on CPU is bound by reading the weights: the default model's Q4_1 blocks are 5 bits a weight, its
fp32 dequantization 32. ``GGMLLinearMethod`` keeps every linear layer whose checkpoint tensors all arrive as
blocks of types the kernel reads (``KERNEL_TYPES``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, every
type of a Q4_K_M file; Gemma 3's, whose width of 640 is no whole number of K-quant blocks, holds Q5_0 in q, k,
gate and up, and Q8_0 or Q5_0 in v) in those blocks, a packed layer whose projections differ in type as one
tensor per run of a type; any other layer (a float tensor, a tied LM head over embeddings of another type) is
dequantized at load and handed to the dense method it wraps.
``dequantize`` (gguf's own numpy reference) then ``F.linear`` is the twin the kernel is tested against: the
kernel dequantizes to the same fp32 values, so the two differ only in the order of the sums.
``--quantize-activations`` multiplies the blocks through ``ggml_qdot``'s int8-activation kernels instead
(llama.cpp's numerics, about twice as fast at one row, and faster than a dense fp32 copy at every larger step,
so that none is kept); this exact kernel also dequantizes the blocks for the dense layouts.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from kvserve.model.layers.linear import AsLoadedLinearMethod, Linear, LinearMethod, apply_by_parts
from kvserve.native import KernelFunction, kernel_range, load_library, optional_kernel

logger = logging.getLogger(__name__)

GGML_GEMM_SOURCE = Path(__file__).parent / "csrc" / "ggml_gemm.c"
GGML_GEMM_RANGE = "kvserve::ggml_gemm"  # the kernel's name in torch.profiler traces
# up to 4 rows (one tile) the weights are read once; a fifth row costs the kernel every block's unpacking again,
# the dense GEMMs nothing. One step's GEMMs of SmolLM2 (benchmarks/cpu_gemm.py, 2 threads, Emerald Rapids): 4 rows
# 13.2 ms against the dense panels' 21.9 (forced AVX2 14.5 against 22.4), 5 rows 25.2 against 23.7 (AVX2)
GGML_MAX_ROWS = 4
# Without a dense copy (``--load-format mmap``), one step's GEMMs on the default model's blocks (ms, 2 threads,
# AMD Zen 5 / the same forced to AVX2; benchmarks/cpu_gemm.py's ``blocks`` and ``mapped`` columns):
#
#     tokens                         8         12         16         64          256
#     rows kernel (ggml_gemm)      10 / 15   15 / 22    20 / 29
#     strips kernel                          19 / 22    21 / 22    49 / 75    193 / 306
#     dense panels (a copy kept)   15 / 15   12 / 15    12 / 20    37 / 70    151 / 285
#
# so the rows kernel serves up to BATCHED_ROWS_KERNEL_ROWS tokens (Zen 4 measured the strips ahead from 12 rows; on
# Zen 5 they cross nearer 14), the strips kernel every larger step. Before docs/results/session29-zen5 steps from
# 256 tokens dequantized the weight a slice at a time for torch's GEMM, then about as fast as the strips (Zen 4: 352
# against 331 ms); since, the strips kernel no longer aliases in L1 and L2 (csrc/ggml_gemm.c), and torch's GEMM
# (MKL) runs at AVX2 speed on AMD's AVX-512 CPUs: at 256 tokens on Zen 5 the slices took 350 ms, the strips 176.
BATCHED_ROWS_KERNEL_ROWS = 8
KERNEL_TYPES = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})
BLOCK_GEMM_ARG_TYPES = (  # every block kernel's GEMM
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]  # y, its row stride, x, its row stride
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]  # blocks, bytes per row, type, bias
    + [ctypes.c_int] * 4  # m, n, k, threads
)


class GGMLTensor(NamedTuple):
    """A 2-D weight in ggml blocks: ``blocks`` uint8 [rows, bytes per row], each row ``shape[1]`` values."""

    blocks: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    @classmethod
    def from_numpy(cls, blocks: np.ndarray, qtype: GGMLQuantizationType, copy: bool = True) -> GGMLTensor:
        """From gguf's reader: its rows of raw blocks (a copy, unless ``copy`` is False: the reader's arrays may
        map the file)."""
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        rows, row_bytes = blocks.shape
        data = torch.from_numpy(np.array(blocks) if copy else blocks)
        return cls(data, qtype, (rows, row_bytes // block_bytes * block_size))

    def dequantize(self) -> torch.Tensor:
        """The fp32 values, as gguf's reference computes them."""
        values = gguf_dequantize(self.blocks.numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)


class BlockGemm(Protocol):
    """A kernel that multiplies by a ``GGMLTensor``: ``x [M, K] @ W.T (+ bias)`` (into ``out`` if given), for
    steps of up to ``max_rows`` rows (from there the dense layout is faster)."""

    max_rows: int
    types: frozenset[GGMLQuantizationType]  # the block types it reads

    def __call__(self, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor: ...

    def batched(self, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The same product at any number of rows, where no dense layout is kept."""
        ...


class GGMLGemm:
    """The compiled exact kernel: ``x [M, K] @ W.T (+ bias)`` for W a ``GGMLTensor`` of a type in
    ``KERNEL_TYPES``, fp32 activations; also dequantizes blocks for the dense layouts."""

    max_rows = GGML_MAX_ROWS
    types = KERNEL_TYPES

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        """``library``: a build of ``GGML_GEMM_SOURCE`` (default: this process's, for its CPU)."""
        library = library or load_library(GGML_GEMM_SOURCE, batch_invariant=False)
        self._gemm = KernelFunction(library.kvserve_ggml_gemm_f32, BLOCK_GEMM_ARG_TYPES, ctypes.c_int)
        self._strips = KernelFunction(library.kvserve_ggml_gemm_strips_f32, BLOCK_GEMM_ARG_TYPES, ctypes.c_int)
        self._dequantize = KernelFunction(library.kvserve_ggml_dequantize,
                                          [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_int] * 4,
                                          ctypes.c_int)
        self._as_q8_0 = KernelFunction(library.kvserve_ggml_as_q8_0,
                                       [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_int] * 4,
                                       ctypes.c_int)
        self._prefers_q8_0 = KernelFunction(library.kvserve_ggml_prefers_q8_0, [ctypes.c_int], ctypes.c_int)

    def __call__(self, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        return call_block_kernel(self._gemm, "ggml GEMM", GGML_GEMM_RANGE, x, weight, bias, out)

    def batched(self, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The product for a step of any number of rows with no dense copy of the weight kept: this kernel up
        to ``BATCHED_ROWS_KERNEL_ROWS`` rows, then the strips kernel (each weight decoded once a call)."""
        if x.shape[0] <= BATCHED_ROWS_KERNEL_ROWS:
            return self(x, weight, bias, out)
        return call_block_kernel(self._strips, "ggml strips GEMM", GGML_GEMM_RANGE, x, weight, bias, out)

    def layout_type(self, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
        """The block type this build multiplies ``qtype``'s values fastest in at one row: Q8_0 for Q5_0 on builds
        without AVX-512 (``csrc/ggml_gemm.c`` states why and the measurements), else ``qtype`` itself."""
        return GGMLQuantizationType.Q8_0 if self._prefers_q8_0(int(qtype)) else qtype

    def fastest_layout(self, weight: GGMLTensor) -> GGMLTensor:
        """``weight`` in blocks of its ``layout_type``, holding the same values (Q5_0 as Q8_0: the same fp16
        scales, the quants as int8, lossless), or ``weight`` itself."""
        if self.layout_type(weight.qtype) == weight.qtype:
            return weight
        n, k = weight.shape
        block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
        blocks = torch.empty(n, k // block_size * block_bytes, dtype=torch.uint8)
        if self._as_q8_0(blocks.data_ptr(), weight.blocks.data_ptr(), weight.blocks.stride(0), int(weight.qtype),
                         n, k, torch.get_num_threads()):
            raise ValueError(f"fastest_layout: {weight.qtype.name} blocks of {k} values do not convert to Q8_0")
        return GGMLTensor(blocks, GGMLQuantizationType.Q8_0, weight.shape)

    def place(self, weight: GGMLTensor, device: torch.device) -> GGMLTensor:
        """The blocks where the kernel reads them: in host memory, as loaded."""
        return weight

    def dequantize(self, weight: GGMLTensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 values of ``weight`` (into ``out`` [rows, k] if given): ``GGMLTensor.dequantize`` in C,
        two orders of magnitude faster, equal to it up to the rounding of a fused multiply-add."""
        n, k = weight.shape
        out = torch.empty(n, k, dtype=torch.float32) if out is None else out
        if out.shape != (n, k) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"dequantize: out {tuple(out.shape)} {out.dtype} is not a contiguous fp32 [{n}, {k}]")
        if weight.qtype not in KERNEL_TYPES or self._dequantize(
            out.data_ptr(), weight.blocks.data_ptr(), weight.blocks.stride(0), int(weight.qtype), n, k,
            torch.get_num_threads(),
        ):
            raise ValueError(f"dequantize: the kernel does not read {weight.qtype.name} blocks of {k} values")
        return out


def call_block_kernel(
    gemm: KernelFunction, name: str, range_name: str, x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` by a block kernel's C function of ``BLOCK_GEMM_ARG_TYPES`` (``name`` in errors,
    ``range_name`` in profiles), into ``out`` [M, N] (its rows may be strided, as a column range of a wider
    output) if given."""
    n, k = weight.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or weight.qtype not in KERNEL_TYPES:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} does not fit a {weight.qtype.name} "
                         f"weight of shape {weight.shape}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32) if out is None else out
    if y.shape != (x.shape[0], n) or y.dtype != torch.float32 or y.stride(1) != 1:
        raise ValueError(f"{name}: out {tuple(y.shape)} {y.dtype} is not fp32 rows of [{x.shape[0]}, {n}]")
    if x.shape[0]:
        with kernel_range(range_name):
            status = gemm(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), weight.blocks.data_ptr(),
                          weight.blocks.stride(0), int(weight.qtype), None if bias is None else bias.data_ptr(),
                          x.shape[0], n, k, torch.get_num_threads())
        if status:
            raise MemoryError(f"{name}: no scratch memory for a {weight.shape} weight and x {tuple(x.shape)}")
    return y


ggml_gemm = optional_kernel(GGMLGemm, "GGUF weights are dequantized at load", logger)


class GGMLLinearMethod(AsLoadedLinearMethod):
    """Keeps a layer's weight in ggml blocks when every checkpoint tensor of it arrives as blocks of a type the
    kernel reads (one tensor per run of a type in a packed layer), multiplied by ``gemm`` (default: ``kernel``,
    the exact one; or the int8-activation ``ggml_qdot.QDotGemm``) for steps of up to its ``max_rows`` tokens.
    Larger steps: with ``keep_dense``, ``dense`` lays the weight out, dequantized by ``kernel``, and serves them
    (fast, at 32 bits a weight held beside the blocks); without, ``gemm.batched`` multiplies the blocks
    themselves, which stay the only copy and may be the file's own mapped pages, one tensor per projection
    (joining them would copy). ``dense``
    serves every step of a layer not kept in blocks. CPU in fp32 (``GGMLGemm``), or CUDA (``triton_ggml``'s
    kernel at any number of rows, no dense copy)."""

    def __init__(self, kernel: GGMLGemm, dense: LinearMethod, gemm: BlockGemm | None = None,
                 keep_dense: bool = True, defer_dense: bool = False) -> None:
        """``defer_dense`` (with ``keep_dense``): loading leaves a layer kept in blocks ``pending_dense``, and
        ``lay_out_dense`` (``deferred_layout.DeferredLayouts``, on a thread of its own after start-up) builds its
        dense layout; until then its larger steps multiply the blocks as without ``keep_dense``."""
        self.kernel = kernel
        self.dense = dense
        self.gemm = gemm or kernel
        self.keep_dense = keep_dense
        self.defer_dense = defer_dense and keep_dense

    def load_tied_weight(self, layer: Linear, tensor: torch.Tensor | GGMLTensor) -> None:
        # a tied LM head multiplies by the embeddings' own blocks
        if isinstance(tensor, GGMLTensor):
            self.load_weight(layer, "weight", tensor, None)

    def process_weights_after_loading(self, layer: Linear) -> None:
        parts = self.loaded_parts(layer)
        qtypes = {part.qtype if isinstance(part, GGMLTensor) else None for part in parts}
        layer.ggml_parts = None
        layer.pending_dense = None
        device, dtype = layer.weight.device, layer.weight.dtype
        if parts and qtypes <= self.kernel.types:
            if self.keep_dense and self.gemm is self.kernel:  # copies allowed: the exact kernel's fastest blocks
                parts = [self.kernel.fastest_layout(part) for part in parts]
            kept = _joined(parts) if self.keep_dense else parts
            layer.ggml_parts = tuple(self.kernel.place(part, device) for part in kept)
            if not self.keep_dense:
                return
            if self.defer_dense:
                layer.pending_dense = layer.ggml_parts
                del layer.weight  # the placeholder: the model's parameters are the same before and after
                return
        if parts:  # the dense method gets the weight as from any other checkpoint
            layer.weight = torch.nn.Parameter(self._dense_weight(parts).to(device, dtype), requires_grad=False)
        self.dense.process_weights_after_loading(layer)  # a tied head holds the embeddings' weight already

    def lay_out_dense(self, layer: Linear) -> None:
        """Build the dense layout of a layer left ``pending_dense`` (``defer_dense``), which its larger steps
        use from then on: safe while steps run on another thread (they read ``pending_dense``, cleared last)."""
        parts = layer.pending_dense
        if parts is None:
            return
        layer.weight = torch.nn.Parameter(self._dense_weight(list(parts)), requires_grad=False)
        self.dense.process_weights_after_loading(layer)
        layer.pending_dense = None

    def _dense_weight(self, parts: list[GGMLTensor | torch.Tensor]) -> torch.Tensor:
        """The parts' fp32 rows, one under the other (blocks the kernel reads are dequantized by it)."""
        dense = torch.empty(sum(part.shape[0] for part in parts), parts[0].shape[1], dtype=torch.float32)
        start = 0
        for part in parts:
            rows = dense[start : start + part.shape[0]]
            if isinstance(part, GGMLTensor) and part.qtype in self.kernel.types:
                self.kernel.dequantize(part, rows)
            else:
                rows.copy_(part.dequantize() if isinstance(part, GGMLTensor) else part)
            start += part.shape[0]
        return dense

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.numel() // layer.in_features
        if layer.ggml_parts is None or (self.keep_dense and num_rows > self.gemm.max_rows
                                        and layer.pending_dense is None):
            return self.dense.apply(layer, x)
        multiply = self.gemm if num_rows <= self.gemm.max_rows else self.gemm.batched
        # mapped: a packed layer's projections where they were loaded
        return apply_by_parts(layer, layer.ggml_parts, x, multiply)


def _joined(parts: list[GGMLTensor]) -> list[GGMLTensor]:
    """A packed layer's projections with each run of one block type joined into one tensor of blocks (one kernel
    call a step for a layer of one type; Gemma 3's q and k are Q5_0 where its v is Q8_0: two calls, one where the
    exact kernel's build takes Q5_0 as Q8_0)."""
    runs: list[list[GGMLTensor]] = []
    for part in parts:
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [run[0] if len(run) == 1 else GGMLTensor(torch.cat([part.blocks for part in run]), run[0].qtype,
                                                     (sum(part.shape[0] for part in run), run[0].shape[1]))
            for run in runs]


def reference_linear(x: torch.Tensor, weight: GGMLTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The twin of ``GGMLGemm``: gguf's dequantization, then ``F.linear``."""
    return F.linear(x, weight.dequantize(), bias)
