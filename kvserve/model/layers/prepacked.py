"""The linear method whose weights are laid out once, at load, for CPU GEMMs: oneDNN's blocked format for steps of
many tokens, and kvserve's column panels (``csrc/small_gemm.c``) for steps of a few.

A plain ``F.linear`` on CPU packs the weight into the GEMM's panel layout on every call: at decode batch sizes
that repacking reads and writes every weight again each step, and it dominates. oneDNN's blocked weights
(``torch.ops.mkldnn._linear_pointwise``, the path PyTorch's own CPU compiler takes for frozen fp32 linears) win
above a hundred tokens; below that a step mostly streams the weights from memory, and the small-GEMM
kernel, which prefetches the next panel while it computes on this one, overlaps that stream with its FMAs.
Measured on 2 cores (AVX-512) at SmolLM2's shapes, one step's GEMMs over all 30 layers and the LM head
(``benchmarks/cpu_gemm.py``, ms):

    tokens in the step     1     16     32     48     64     96    128    256
    F.linear             26     65     73     96    110    133    156    288
    oneDNN blocked       33     47     63     85    124    128    149    269
    small-GEMM panels    25     37     48     63     94    114    165    305

The same on AVX2 (2-core AMD EPYC Zen 2; other jobs shared the cores, so only the same-run ratios hold), with
the kernel built for AVX2 (8-wide vectors, panels of 16 columns, tiles of 6 rows):

    tokens in the step     1     16     32     64     96
    oneDNN blocked       41.8  117.2  214.1  320.8  437.3
    small-GEMM panels    32.8   78.4  201.0  265.3  385.8

Keeping both layouts doubles the memory of the linear weights; the panels are kept only where the kernel was
built for a vector ISA it was measured on (AVX-512, or AVX2 with FMA). ``KVSERVE_CPU_ISA=avx2`` builds the AVX2
kernel on an AVX-512 machine (``kvserve.native``).

Where the panels stop (``MAX_PANEL_ROWS``) depends on the ISA and the CPU's maker, and for AMD's AVX-512 on its
family. On AVX-512 oneDNN takes steps of more than 96 tokens (the table above; on a Zen 4 the two are level from
256 tokens up), except on Zen 5 (the last table).
With AVX2 kernels, one step's GEMMs of SmolLM2 on 2 threads held to AVX2 (``KVSERVE_CPU_ISA=avx2
ONEDNN_MAX_CPU_ISA=AVX2``), ms (Zen 4: 24 layers' projections; Intel Emerald Rapids: ``benchmarks/cpu_gemm.py``,
every layer and the head):

    tokens in the step                96    128    192    256    512
    Zen 4      oneDNN blocked       24.2   29.2          54.1  107.1
               small-GEMM panels    20.0   26.4          50.8  101.8
    Intel EMR  oneDNN blocked      199.0  253.5  366.4  464.9  913.6
               small-GEMM panels   178.9  234.0  377.5  501.6 1136.0
    (later)    oneDNN blocked      220.1  274.4  460.4
               small-GEMM panels   206.5  276.3  531.9

so on AMD's cores the panels take every step and no oneDNN copy is made (half the linear weights' memory); on
Intel's, whose AVX2 FMAs are half their AVX-512 ones, oneDNN's blocking wins from about 128 tokens up (the first
Intel rows, docs/results/session13-emr, put the two level at 192; three later passes, docs/results/session19-emr,
had the panels 13-17% behind there and level at 96 and 128).

AMD's Zen 5 (family 26) runs AVX-512 on full-width units, and there the AVX-512 panels are as fast as oneDNN or
faster at every size (``benchmarks/cpu_gemm.py``, every layer and the head, 2 threads, ms):

    tokens in the step     16     64     96    128    192    256    512
    oneDNN blocked       19.5   45.7   59.3   76.7  109.6  156.3  299.2
    small-GEMM panels    13.5   37.4   52.1   68.1  100.9  145.8  296.3

so from that family on they take every step, as with AVX2 on AMD (Zen 4, family 25, keeps oneDNN above 96).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvserve.model.layers.linear import Linear, UnquantizedLinearMethod
from kvserve.native import KernelFunction, cpu_family, cpu_vendor, kernel_range, load_library, optional_kernel

logger = logging.getLogger(__name__)

SMALL_GEMM_SOURCE = Path(__file__).parent / "csrc" / "small_gemm.c"
# the most tokens a step multiplies by the panels, by the ISA the kernel was built for, the CPU's maker ("": any
# other) and the first family of that maker an entry holds for; None: every step (AVX-512: from about 112 rows
# up oneDNN is as fast, except on Zen 5, see the tables above; a generic build is correct but not used by the
# engine, ``small_gemm``)
MAX_PANEL_ROWS = {("avx512", "", 0): 96, ("avx512", "AuthenticAMD", 26): None, ("avx2", "AuthenticAMD", 0): None,
                  ("avx2", "", 0): 128, ("generic", "", 0): 96}
ISA_NAMES = {2: "avx512", 1: "avx2", 0: "generic"}  # kvserve_small_gemm_isa()'s codes
SMALL_GEMM_RANGE = "kvserve::small_gemm"  # the kernel's name in torch.profiler traces (a ctypes call is no op)
_C_ARG_TYPES = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]  # y, its row stride, x, its
                + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4)  # panels, bias, m, n, k, threads


def max_panel_rows(isa: str, vendor: str, family: int) -> int | None:
    """``MAX_PANEL_ROWS``'s most specific entry for a build and a CPU: the maker's own before any maker's, then
    the latest family the CPU is of."""
    key = max((key for key in MAX_PANEL_ROWS if key[0] == isa and key[1] in ("", vendor) and family >= key[2]),
              key=lambda key: (key[1] != "", key[2]))
    return MAX_PANEL_ROWS[key]


class SmallGemm:
    """The compiled small-GEMM kernel: ``pack`` lays a weight out in panels once, a call multiplies by it."""

    def __init__(self, library: ctypes.CDLL | None = None, vendor: str | None = None) -> None:
        """``library``: a build of ``SMALL_GEMM_SOURCE`` (default: this process's, for its CPU); ``vendor``: the
        CPU's maker (default: this machine's, ``native.cpu_vendor``); the family is this machine's
        (``native.cpu_family``)."""
        library = library or load_library(SMALL_GEMM_SOURCE)
        self.panel_width: int = library.kvserve_small_gemm_panel()
        self.isa = ISA_NAMES[library.kvserve_small_gemm_isa()]
        self.tuned = self.isa != "generic"  # built for a vector ISA where it was measured to win
        vendor = cpu_vendor() if vendor is None else vendor
        self.max_rows: int | None = max_panel_rows(self.isa, vendor, cpu_family())  # the most rows a step gives it
        self._gemm = KernelFunction(library.kvserve_small_gemm_f32, _C_ARG_TYPES)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] fp32 -> [ceil(N / panel), K, panel]: each panel's columns side by side, k after k."""
        n, k = weight.shape
        width, weight = self.panel_width, weight.detach().to(torch.float32)
        num_full, rest = divmod(n, width)
        panels = torch.empty(num_full + bool(rest), k, width)
        # one strided copy per panel group (padding first and then transposing copied every weight twice more,
        # a third of the default model's load time)
        panels[:num_full].copy_(weight[: num_full * width].view(num_full, width, k).transpose(1, 2))
        if rest:  # the last panel's columns past n are zeros
            panels[num_full].zero_()[:, :rest].copy_(weight[num_full * width :].T)
        return panels

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """x [M, K] (rows may be strided, elements not) times the packed [N, K] weight, plus bias: [M, N]."""
        m, k = x.shape
        if x.dtype != torch.float32 or panels.shape[1] != k or panels.shape[0] * self.panel_width < n:
            raise ValueError(f"small GEMM: x {tuple(x.shape)} {x.dtype} does not fit panels {tuple(panels.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            with kernel_range(SMALL_GEMM_RANGE):
                self._gemm(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), panels.data_ptr(),
                           None if bias is None else bias.data_ptr(), m, n, k, torch.get_num_threads())
        return y


def _tuned_small_gemm() -> SmallGemm | None:
    """The kernel where it is worth its memory (tuned for this CPU), else None."""
    kernel = SmallGemm()
    return kernel if kernel.tuned else None


small_gemm = optional_kernel(_tuned_small_gemm, "CPU GEMMs of a few tokens use oneDNN alone", logger)


class CpuPrepackedLinearMethod(UnquantizedLinearMethod):
    """Loads the weight as ``UnquantizedLinearMethod`` does, then reorders it for oneDNN, and also lays it out in
    panels for ``small`` when given (panels alone where ``small`` serves every step); the plain weight is not kept
    (a tied head's weight, the embeddings', is laid out into copies of its own). fp32 only: see ``can_prepack``."""

    def __init__(self, small: SmallGemm | None) -> None:
        self.small = small

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = layer.weight.detach()
        small = self.small
        every_step = small is not None and small.max_rows is None
        layer.packed_weight = None if every_step else torch.ops.mkldnn._reorder_linear_weight(weight, None)
        layer.panels = small.pack(weight) if small is not None else None
        layer.max_panel_elements = None if every_step else (small.max_rows * layer.in_features if small else -1)
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.max_panel_elements is not None and x.numel() > layer.max_panel_elements:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")
        y = self.small(x.reshape(-1, layer.in_features), layer.panels, layer.bias, layer.out_features)
        return y.view(*x.shape[:-1], layer.out_features)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 on a CPU build of torch that has oneDNN and the op (an internal one: checked, not assumed)."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
