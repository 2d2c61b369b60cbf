"""Paged attention for fp32 on CPU that reads decode keys and values in place from the blocks.

The reference backend copies every key and value a step reads into a workspace before SDPA reads them again;
on CPU, decodes are bound by those bytes (32 decodes x 440 keys is ~20 MB of fp32 K/V per layer). Here each
decode streams its own blocks once through a small C kernel (``csrc/paged_decode.c``: OpenMP over sequences
and KV heads, online softmax, the query heads of a KV head sharing each key row; decodes whose block tables
start with the same blocks, prefix-cache hits or samples of one prompt, read those shared keys once for all
their queries and go on alone from that softmax state), while prefill chunks, which
are bound by FLOPs rather than bytes, keep SDPA over a gather of their keys (measured: SDPA beats running
each chunk query through the kernel by 1.2-1.7x); the reference backend runs them as a sub-step of their own::

    q rows:  | d0 | d1 | ... | d{D-1} |  chunk 0  |  chunk 1  | ...
             |<-- decode kernel ---->|<-- TorchRefBackend --->|

The kernel is compiled with the system's gcc at first use (about a second) into the user's cache folder,
keyed by a hash of its source, the flags and the CPU, and called through ctypes with raw pointers, on
torch's thread count. Where torch ships GNU OpenMP (the Linux wheels) the library binds to torch's
``libgomp.so.1``, already loaded, so the kernel and torch's ops share one thread pool rather than fighting.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import platformdirs
import torch

from kvserve.attention.backend import AttentionBackend, AttentionInputs, AttentionMetadata
from kvserve.attention.torch_ref import TorchRefBackend, TorchRefMetadata, _validate
from kvserve.kv.storage import KVCacheStorage

KERNEL_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120
DECODE_KERNEL_RANGE = "kvserve::paged_decode"  # the kernel's name in torch.profiler traces (a ctypes call is no op)
_C_ARG_TYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]  # out, its row stride, q, its row stride
    + [ctypes.c_void_p] * 2 + [ctypes.c_int64]  # k/v caches, num_blocks
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # block tables + stride, seq lens
    + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]  # num_seqs .. window, scale, num_threads
)


class KernelBuildError(RuntimeError):
    """The decode kernel could not be compiled or loaded (no compiler, a compile error, an unloadable library)."""


@dataclass(frozen=True)
class CpuPagedMetadata(AttentionMetadata):
    """The step's inputs, the decodes' kernel arguments, and the prefill chunks as a reference sub-step."""

    inputs: AttentionInputs
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks], contiguous
    decode_seq_lens: torch.Tensor  # int32 [num_decodes], contiguous
    prefill: TorchRefMetadata | None  # None: the step has no prefill chunk


class CpuPagedBackend(AttentionBackend):
    """Decodes through the in-place C kernel, prefill chunks through ``TorchRefBackend``; fp32 on CPU only.

    Construction builds (or loads the cached) kernel and raises ``KernelBuildError`` when it cannot.
    """

    def __init__(self) -> None:
        self._decode = decode_kernel()
        self._prefill = TorchRefBackend()

    def build_metadata(self, inputs: AttentionInputs, sliding_windows: set[int | None]) -> CpuPagedMetadata:
        _validate(inputs)
        if inputs.seq_lens.device.type != "cpu":
            raise ValueError(f"CpuPagedBackend runs on CPU; the step's tensors are on {inputs.seq_lens.device}")
        num_decodes = inputs.num_decodes
        if num_decodes and max(inputs.seq_lens_list[:num_decodes]) > inputs.block_tables.shape[1] * inputs.block_size:
            raise ValueError(f"the block tables ({inputs.block_tables.shape[1]} blocks wide) are too narrow for "
                             f"decodes of up to {max(inputs.seq_lens_list[:num_decodes])} tokens")
        chunks = _prefill_substep(inputs) if num_decodes < inputs.num_seqs else None
        return CpuPagedMetadata(
            inputs=inputs,
            decode_block_tables=inputs.block_tables[:num_decodes].to(torch.int32).contiguous(),
            decode_seq_lens=inputs.seq_lens[:num_decodes].to(torch.int32).contiguous(),
            prefill=self._prefill.build_metadata(chunks, sliding_windows) if chunks is not None else None,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        kv: KVCacheStorage,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if not isinstance(meta, CpuPagedMetadata):
            raise TypeError(f"CpuPagedBackend needs CpuPagedMetadata, got {type(meta).__name__}")
        _check_shapes(q, k, kv, layer, meta.inputs)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding window must be a positive number of tokens, got {sliding_window}")
        num_decodes = meta.inputs.num_decodes
        out = torch.empty(q.shape, dtype=q.dtype)
        if num_decodes:
            kv.write(layer, k[:num_decodes], v[:num_decodes], meta.inputs.slot_mapping[:num_decodes])
            self._attend_decodes(q, out, layer, kv, meta, scale, sliding_window)
        if meta.prefill is not None:  # writes the chunks' K/V itself
            out[num_decodes:] = self._prefill.forward(
                q[num_decodes:], k[num_decodes:], v[num_decodes:], layer, kv, meta.prefill,
                scale=scale, sliding_window=sliding_window,
            )
        return out

    def _attend_decodes(
        self, q: torch.Tensor, out: torch.Tensor, layer: int, kv: KVCacheStorage, meta: CpuPagedMetadata,
        scale: float, sliding_window: int | None,
    ) -> None:
        num_heads, head_dim = q.shape[1:]
        if q.stride(2) != 1 or q.stride(1) != head_dim:  # the kernel walks heads head_dim apart within a row
            q = q.contiguous()
        tables, num_kv_heads = meta.decode_block_tables, kv.spec.num_kv_heads
        with torch.profiler.record_function(DECODE_KERNEL_RANGE):
            num_bad = self._decode(
                out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0),
                kv.k_caches[layer].data_ptr(), kv.v_caches[layer].data_ptr(), kv.num_blocks,
                tables.data_ptr(), tables.stride(0), meta.decode_seq_lens.data_ptr(), meta.inputs.num_decodes,
                num_kv_heads, num_heads // num_kv_heads, head_dim, meta.inputs.block_size, sliding_window or 0, scale,
                torch.get_num_threads(),
            )
        if num_bad < 0:
            raise MemoryError("the decode kernel could not allocate its plan of shared-prefix groups")
        if num_bad:
            raise ValueError(f"a decode's block table names a block outside the cache's {kv.num_blocks} blocks")


def _prefill_substep(inputs: AttentionInputs) -> AttentionInputs:
    """The step without its decodes: the chunks' rows, renumbered from 0."""
    first = inputs.num_decodes
    query_start_loc = inputs.query_start_loc[first:]
    return replace(
        inputs,
        num_decodes=0,
        query_start_loc=query_start_loc - query_start_loc[0],
        seq_lens=inputs.seq_lens[first:],
        block_tables=inputs.block_tables[first:],
        slot_mapping=inputs.slot_mapping[first:],  # decodes have one token each, so rows == sequences
        query_lens_list=inputs.query_lens_list[first:],
        seq_lens_list=inputs.seq_lens_list[first:],
    )


def _check_shapes(q: torch.Tensor, k: torch.Tensor, kv: KVCacheStorage, layer: int, inputs: AttentionInputs) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if (num_tokens != inputs.num_tokens or num_heads % k.shape[1] or k.shape[1] != kv.spec.num_kv_heads
            or head_dim != kv.spec.head_dim):
        raise ValueError(
            f"q {tuple(q.shape)} / k {tuple(k.shape)} do not fit a step of {inputs.num_tokens} tokens with "
            f"num_heads a multiple of the cache's num_kv_heads={kv.spec.num_kv_heads} and head_dim={kv.spec.head_dim}"
        )
    caches = (kv.k_caches[layer], kv.v_caches[layer])
    if q.dtype != torch.float32 or any(c.dtype != torch.float32 or not c.is_contiguous() for c in caches):
        raise TypeError(
            f"CpuPagedBackend needs fp32 queries and contiguous fp32 caches; got {q.dtype} and {caches[0].dtype}"
        )


# --- the kernel: compiled once per source, flags and CPU, cached in the user's cache folder ---------------------


def decode_kernel() -> Callable[..., int]:
    """The compiled ``kvserve_paged_decode_f32``; raises ``KernelBuildError`` (every time) if it cannot be had."""
    kernel = _load_once()
    if isinstance(kernel, KernelBuildError):
        raise KernelBuildError(str(kernel))
    return kernel


@functools.cache
def _load_once() -> Callable[..., int] | KernelBuildError:
    """Build at most once per process, remembering a failure too (a retry would fail the same way)."""
    try:
        return _load(_library_path())
    except KernelBuildError as error:
        return error


def _library_path() -> Path:
    try:
        source = KERNEL_SOURCE.read_bytes()
    except OSError as error:
        raise KernelBuildError(f"the kernel source {KERNEL_SOURCE} is missing: {error}") from error
    key = hashlib.sha256(b"\0".join([source, " ".join(COMPILE_FLAGS).encode(), _cpu_id().encode()])).hexdigest()
    path = Path(platformdirs.user_cache_dir("kvserve")) / "kernels" / f"paged_decode-{key[:16]}.so"
    if not path.exists():
        _compile(path)
    return path


def _cpu_id() -> str:
    """What ``-march=native`` depends on: a library built for one CPU may not run on another sharing the cache."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    return platform.machine() + next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")


def _compile(path: Path) -> None:
    compiler = shutil.which("gcc")
    if compiler is None:
        raise KernelBuildError("no C compiler: gcc is not on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename, so concurrent processes never load a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *COMPILE_FLAGS, str(KERNEL_SOURCE), "-o", tmp, "-lm"],
            capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise KernelBuildError(f"gcc failed to compile {KERNEL_SOURCE.name}:\n{result.stderr.strip()}")
        os.replace(tmp, path)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise KernelBuildError(f"could not build {KERNEL_SOURCE.name} into {path}: {error}") from error
    finally:
        Path(tmp).unlink(missing_ok=True)


def _load(path: Path) -> Callable[..., int]:
    try:
        # torch already loaded its libgomp.so.1, so the kernel's OpenMP runs on torch's thread pool
        function = ctypes.CDLL(str(path)).kvserve_paged_decode_f32
    except (OSError, AttributeError) as error:
        raise KernelBuildError(f"could not load the decode kernel {path}: {error}") from error
    function.argtypes = _C_ARG_TYPES
    function.restype = ctypes.c_int
    return function
