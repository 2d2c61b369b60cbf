"""How a model's linear layers hold their weights, chosen once at load from the checkpoint, the device, the dtype
and the options: as loaded ("dense"), a GGUF's blocks kept ("gguf"), the file's mapped blocks or tensors ("gguf-mmap",
"dense-mmap"), quantized at load ("int8", "int4") or in fp8; and why a format asked for cannot run, said in one
ValueError. ``registry.select_linear_method`` then builds the method that holds them so."""

from __future__ import annotations

import logging

import torch

from kvserve.model.layers.fp8 import fp8_unsupported
from kvserve.model.layers.ggml import KERNEL_TYPES, ggml_gemm
from kvserve.model.layers.weight_quant import WEIGHT_ONLY_SCHEMES
from kvserve.model.loader import Checkpoint

logger = logging.getLogger(__name__)


def weight_format(
    quantization: str, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype, dtype_forced: bool,
    tensor_parallel_size: int = 1, load_format: str = "auto",
) -> str:
    """How the linear layers hold their weights: "dense" (as loaded, in ``dtype``), "gguf" (a GGUF's blocks kept,
    see ``keeps_gguf_blocks``, with a dense copy for steps of many tokens), "gguf-mmap" / "dense-mmap"
    (``load_format="mmap"``: a GGUF's blocks or a safetensors checkpoint's tensors where the file is mapped, the
    only copy), "int8" / "int4" (quantized at load), or "fp8" (e4m3 weights and activations); ValueError where
    they cannot run. Tensor-parallel layers are dense
    (``EngineConfig`` refuses the other formats by name; ``auto`` dequantizes)."""
    if load_format == "mmap":
        return _mapped_format(quantization, checkpoint, device, dtype, dtype_forced, tensor_parallel_size)
    if load_format == "dummy" and quantization in ("auto", "none", "gguf"):
        if quantization == "gguf":
            raise ValueError("load_format='dummy' draws dense random weights; quantization='gguf' keeps a GGUF's "
                             "blocks, which it does not read (use quantization='auto', 'int8', 'int4' or 'fp8')")
        return "dense"  # a GGUF's shapes, without its blocks
    if tensor_parallel_size > 1:
        if checkpoint.is_gguf:
            logger.info("tensor parallel: the GGUF's weights are dequantized to %s (blocks are not sharded)", dtype)
        return "dense"
    if quantization == "fp8":
        why = fp8_unsupported(device)
        if why:
            raise ValueError(f"quantization='fp8': {why}")
        return "fp8"
    if quantization in WEIGHT_ONLY_SCHEMES:
        if device.type == "cuda":
            return quantization  # triton_weight_only's kernel, in any of the model dtypes
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"quantization={quantization!r} runs on CUDA, or on CPU with fp32 activations, not "
                             f"{device.type} {dtype}")
        if ggml_gemm() is None:
            raise ValueError(f"quantization={quantization!r}: the block kernel could not be built (see the warning)")
        return quantization
    return "gguf" if keeps_gguf_blocks(quantization, checkpoint, device, dtype, dtype_forced) else "dense"


def check_quantize_activations(weights: str, device: torch.device) -> None:
    """ValueError where ``quantize_activations`` would change nothing: int8 activations multiply weights kept
    quantized on CPU (a GGUF's blocks, or int8 / int4 weight-only), and only those."""
    if device.type != "cpu" or weights not in ("gguf", "gguf-mmap", *WEIGHT_ONLY_SCHEMES):
        held = f"{weights} weights on {device.type}"
        raise ValueError(f"quantize_activations (--quantize-activations) applies to weights kept quantized on CPU "
                         f"(a GGUF's blocks, or quantization int8 / int4), not to {held}")


def _mapped_format(
    quantization: str, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype, dtype_forced: bool,
    tensor_parallel_size: int,
) -> str:
    """ "gguf-mmap" or "dense-mmap", or ValueError saying why ``load_format="mmap"`` cannot run these weights
    where the file is mapped: only a layout the file holds as it is runs from it (a cast, sharded, dequantized or
    re-quantized layout is made at load, a device's copy on the device)."""
    stored = "a GGUF's quantized blocks" if checkpoint.is_gguf else "a safetensors checkpoint's tensors"
    if device.type != "cpu":
        why = f"device {device.type} holds its own copy (files are mapped on CPU)"
    elif tensor_parallel_size > 1:
        why = f"tensor_parallel_size={tensor_parallel_size} shards dense weights"
    elif checkpoint.is_gguf:
        why = _why_blocks_unmapped(quantization, checkpoint, device, dtype, dtype_forced)
    else:
        why = _why_tensors_unmapped(quantization, checkpoint.stored_dtypes, dtype)
    if why:
        raise ValueError(f"load_format='mmap' runs {stored} from the mapped file; {why} (use load_format='auto')")
    return "gguf-mmap" if checkpoint.is_gguf else "dense-mmap"


def _why_blocks_unmapped(
    quantization: str, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype, dtype_forced: bool
) -> str:
    """Why a GGUF's blocks cannot run from its mapped file ("" where they can)."""
    if quantization not in ("auto", "gguf"):
        return f"quantization={quantization!r} lays the weights out anew at load"
    if dtype_forced:
        return f"dtype={str(dtype).removeprefix('torch.')} dequantizes the blocks"
    try:
        keeps_gguf_blocks("gguf", checkpoint, device, dtype, dtype_forced=False)
    except ValueError as error:
        return str(error).removeprefix("quantization='gguf': ")
    return ""


def _why_tensors_unmapped(quantization: str, stored_dtypes: frozenset[torch.dtype], dtype: torch.dtype) -> str:
    """Why a safetensors checkpoint's tensors cannot be the weights as mapped ("" where they can)."""
    if quantization == "gguf":
        return "quantization='gguf' keeps a GGUF's blocks, and this checkpoint is not a GGUF file"
    if quantization not in ("auto", "none"):
        return f"quantization={quantization!r} lays the weights out anew at load"
    cast = sorted(str(stored).removeprefix("torch.") for stored in stored_dtypes - {dtype})
    if not cast:
        return ""
    run = str(dtype).removeprefix("torch.")
    hint = f" (dtype={cast[0]!r} maps them)" if len(stored_dtypes) == 1 else ""
    return f"the checkpoint stores {', '.join(cast)} tensors and the model runs in {run}: a cast copies them{hint}"


def keeps_gguf_blocks(
    quantization: str, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype, dtype_forced: bool
) -> bool:
    """Whether the linear layers keep a GGUF's quantized blocks: ``auto`` does where the kernel runs (CPU, fp32
    activations) unless a dtype was asked for (which dequantizes, as before); ``gguf`` must (on CUDA too, by
    Triton's kernel) or raises ValueError saying why it cannot."""
    if quantization == "none" or not checkpoint.is_gguf and quantization == "auto":
        return False
    possible = "" if checkpoint.is_gguf else "the checkpoint is not a GGUF file"
    unread = _unread_block_types(checkpoint, device)
    if quantization == "gguf" and unread and not possible:
        raise ValueError(f"quantization='gguf': the block kernel does not read {unread}, which would be dequantized "
                         "(use quantization='auto', which does that)")
    if not possible and device.type == "cuda":
        # Triton's kernel, at the model's dtype: asked for by name until a GPU session has measured it
        return quantization == "gguf"
    if not possible and (device.type != "cpu" or dtype != torch.float32):
        possible = f"GGUF blocks run on CPU with fp32 activations or on CUDA, not {device.type} {dtype}"
    if not possible and ggml_gemm() is None:
        possible = "the GGUF block kernel could not be built (see the warning above)"
    if quantization == "gguf" and possible:
        raise ValueError(f"quantization='gguf': {possible}")
    keeps = not possible and not (quantization == "auto" and dtype_forced)
    if keeps and unread:
        logger.warning("the GGUF's %s: dequantized at load, beside the blocks kept", unread)
    return keeps


def _unread_block_types(checkpoint: Checkpoint, device: torch.device) -> str:
    """The GGUF's quantized matrices of types the block kernel (Triton's on CUDA) does not read, as "Q2_K
    (blk.0.ffn_down.weight and 2 more)"; "" where there are none."""
    from gguf import GGMLQuantizationType

    floats = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    by_type: dict[str, list[str]] = {}
    for name, qtype in checkpoint.gguf_matrix_types.items():
        if qtype not in kept_block_types(device) and qtype not in floats:
            by_type.setdefault(GGMLQuantizationType(qtype).name, []).append(name)
    return "; ".join(f"{kind} ({names[0]}" + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
                     for kind, names in sorted(by_type.items()))


def kept_block_types(device: torch.device) -> frozenset[int]:
    """The GGUF block types the linear layers keep on ``device``: those its kernel reads (Triton's on CUDA)."""
    if device.type == "cuda":
        from kvserve.model.layers.triton_ggml import TRITON_TYPES

        return TRITON_TYPES
    return KERNEL_TYPES
