"""Architecture name -> model class; building a model with the linear method and the fused elementwise ops of its
device and dtype, and loading it ready to run. The one place either is chosen: model files only name shapes."""

from __future__ import annotations

import logging

import torch
from transformers import PretrainedConfig

from kvserve.attention.backend import AttentionBackend
from kvserve.model.base import CausalLM
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.layers.cpu_fused_ops import can_fuse, cpu_fused_ops
from kvserve.model.layers.embedding import VocabEmbedding
from kvserve.model.layers.fp8 import Fp8LinearMethod
from kvserve.model.layers.fused_ops import TorchFusedOps, UsesFusedOps
from kvserve.model.layers.ggml import GGMLLinearMethod, ggml_gemm
from kvserve.model.layers.ggml_qdot import qdot_gemm
from kvserve.model.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from kvserve.model.layers.mapped import MappedLinearMethod
from kvserve.model.layers.tensor_parallel import TensorParallel, shard_model
from kvserve.model.layers.prepacked import CpuPrepackedLinearMethod, can_prepack, small_gemm
from kvserve.model.layers.weight_quant import WEIGHT_ONLY_SCHEMES, WeightOnlyLinearMethod
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import Checkpoint
from kvserve.model.offload import offload_weights
from kvserve.model.weight_format import kept_block_types
from kvserve.model.mistral import MistralForCausalLM
from kvserve.model.qwen2 import Qwen2ForCausalLM
from kvserve.model.qwen3 import Qwen3ForCausalLM

logger = logging.getLogger(__name__)

# dummy weights' range: small enough that activations neither overflow bf16 nor vanish through the norms
DUMMY_WEIGHT_BOUND = 1e-3

# each family's config model_type -> its class (named as transformers names its own)
_FAMILIES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
    # transformers reads a Mistral config with ``layer_types`` as Ministral's (alternating sliding layers)
    "ministral": MistralForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}
# by a config's ``architectures`` entry, and by its model_type for configs that name none
MODEL_CLASSES: dict[str, type[CausalLM]] = {cls.__name__: cls for cls in _FAMILIES.values()}
MODEL_CLASSES["MinistralForCausalLM"] = MistralForCausalLM
MODEL_TYPES: dict[str, str] = {model_type: cls.__name__ for model_type, cls in _FAMILIES.items()}


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture kvserve has no model class for."""


def get_model_class(config: PretrainedConfig) -> type[CausalLM]:
    """The class for ``config.architectures[0]``, or for ``config.model_type`` when no architecture is named. An
    architecture of another family than the config's model_type is refused: the class would read fields the
    config does not have."""
    architectures = getattr(config, "architectures", None)
    if architectures:
        architecture = architectures[0]
    else:
        architecture = MODEL_TYPES.get(config.model_type, f"model_type {config.model_type!r}")
    if architecture not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}"
        )
    model_class = MODEL_CLASSES[architecture]
    family = _FAMILIES.get(config.model_type)
    if family is not None and family is not model_class:
        raise UnsupportedModelError(f"the config's architectures names {architecture!r} but its model_type is "
                                    f"{config.model_type!r} (whose architecture is {family.__name__}): they must "
                                    "agree")
    return model_class


def select_linear_method(
    device: torch.device, dtype: torch.dtype, weights: str = "dense", quantize_activations: bool = False,
    defer_dense: bool = False,
) -> LinearMethod:
    """Prepacked oneDNN weights (and small-GEMM panels where that kernel is tuned) for fp32 on CPU; the plain
    weights elsewhere (on CUDA with a skinny Triton GEMM for decode steps, ``_plain_method``), or where the file
    is mapped (``weights="dense-mmap"``); in front of those, a GGUF's blocks kept (``"gguf"``, or "gguf-mmap") or
    every weight quantized at load (``"int8"``, ``"int4"``), as ``weight_format`` decided, multiplied by the
    block kernel's int8-activation path (``quantize_activations``, where it builds: at every step size, no dense
    copy kept) or its exact fp32 one. ``defer_dense``: kept blocks' prepacked dense copies are left for
    ``deferred_layout.DeferredLayouts`` to lay out after start-up."""
    if weights == "fp8":
        return Fp8LinearMethod()
    if weights == "dense-mmap":
        return MappedLinearMethod()
    if weights == "gguf" and device.type == "cuda":
        from kvserve.model.layers.triton_ggml import TritonGGMLGemm  # imports triton: CUDA only

        return GGMLLinearMethod(TritonGGMLGemm(), UnquantizedLinearMethod(), keep_dense=False)
    if weights in WEIGHT_ONLY_SCHEMES and device.type == "cuda":
        from kvserve.model.layers.triton_weight_only import TritonWeightOnlyLinearMethod  # imports triton

        return TritonWeightOnlyLinearMethod(weights)
    dense = CpuPrepackedLinearMethod(small_gemm()) if can_prepack(device, dtype) else _plain_method(device)
    if weights == "dense":
        return dense
    kernel = ggml_gemm()
    assert kernel is not None, "weight_format() said no block kernel was needed"
    gemm = (qdot_gemm() if quantize_activations else None) or kernel
    if weights in ("gguf", "gguf-mmap"):
        # the int8-activation kernel's strips beat the dense copy at every step size (ggml_qdot.py): none is kept,
        # here or for the weights quantized at load below
        return GGMLLinearMethod(kernel, dense, gemm, keep_dense=weights == "gguf" and gemm is kernel,
                                defer_dense=defer_dense and isinstance(dense, CpuPrepackedLinearMethod))
    return WeightOnlyLinearMethod(kernel, dense, weights, gemm, keep_dense=gemm is kernel)


def _plain_method(device: torch.device) -> LinearMethod:
    """The checkpoint's weights as they are: on CUDA with Triton's skinny GEMM for the few rows of a decode step,
    where it measures faster than torch's."""
    if device.type == "cuda":
        try:
            from kvserve.model.layers.triton_skinny import TritonSkinnyLinearMethod  # imports triton
        except ImportError as error:
            logger.warning("decode steps' GEMMs all run through torch: %s", error)
        else:
            return TritonSkinnyLinearMethod()
    return UnquantizedLinearMethod()


def select_fused_ops(device: torch.device, dtype: torch.dtype) -> TorchFusedOps:
    """The C kernels of ``cpu_fused_ops`` for fp32 on CPU where they build; the Triton kernels of
    ``triton_fused_ops`` on CUDA where triton imports; the plain-PyTorch twin elsewhere."""
    if device.type == "cuda":
        try:
            from kvserve.model.layers.triton_fused_ops import TritonFusedOps  # imports triton
        except ImportError as error:
            logger.warning("CUDA elementwise ops run op by op in PyTorch: %s", error)
            return TorchFusedOps()
        return TritonFusedOps()
    fused = cpu_fused_ops() if can_fuse(device, dtype) else None
    return fused or TorchFusedOps()


def build_model(
    config: PretrainedConfig,
    backend: AttentionBackend | None,
    dtype: torch.dtype,
    device: torch.device | str,
    linear_method: LinearMethod | None = None,
    fused_ops: TorchFusedOps | None = None,
    head_method: LinearMethod | None = None,
    tp: TensorParallel = TensorParallel(),
) -> CausalLM:
    """The model for ``config`` in ``dtype`` on ``device``, its parameters allocated but not initialised:
    ``load_weights`` must fill them (it checks that every one is filled), then
    ``process_weights_after_loading`` finishes the linear layers. Every linear layer gets ``linear_method``
    (default: the plain weights) but the LM head, which gets ``head_method`` (default: ``linear_method``); every
    norm, attention and MLP ``fused_ops`` (default: the plain twin). With ``tp.size`` > 1 the model holds this
    rank's part of every shardable layer (``tensor_parallel.shard_model``; ShardingError if a shape does not
    split). ``backend`` None: a model that never runs (``check_shardable``'s dry run on the meta device)."""
    model_class = get_model_class(config)
    linear_method = linear_method or UnquantizedLinearMethod()
    head_method = head_method or linear_method
    fused_ops = fused_ops or TorchFusedOps()
    with torch.device("meta"):  # no memory and no random init for weights about to be overwritten
        # cast before binding: a method's parameters keep the dtypes it chose (a quantized weight, its scales)
        model = model_class(config, backend).to(dtype=dtype)
        head = getattr(model, "lm_head", None)
        if tp.size > 1:
            shard_model(model, head, tp)
        for layer in model.modules():
            if isinstance(layer, Linear):
                layer.bind(head_method if layer is head else linear_method, dtype)
            if isinstance(layer, UsesFusedOps):
                layer.ops = fused_ops
    # ``to_empty``'s empty_like of a meta tensor runs torch's Python reference, whose first use imports sympy
    # (0.4 s of a 5 s start-up); an empty of the same shape does not
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    return model


def check_shardable(config: PretrainedConfig, tensor_parallel_size: int) -> None:
    """Raise ``ShardingError`` naming the shape that does not split over ``tensor_parallel_size`` ranks: a dry run
    of ``build_model`` on the meta device (no memory), before any worker process starts."""
    build_model(config, None, torch.float32, "meta", tp=TensorParallel(0, tensor_parallel_size))


def process_weights_after_loading(model: CausalLM) -> None:
    """Let each linear layer's method re-lay out its loaded weights (once, after ``load_weights``)."""
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.process_weights_after_loading()


def load_model(
    checkpoint: Checkpoint, backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
    weights: str = "dense", quantize_activations: bool = False, tp: TensorParallel = TensorParallel(),
    cpu_offload_bytes: int = 0, defer_dense: bool = False,
) -> CausalLM:
    """The checkpoint's model on ``device`` in ``dtype``, ready to run: built with the linear method and fused ops
    chosen for them, its weights loaded and laid out for that method, in eval mode; ``tp``'s rank's part of it.
    On CUDA, up to ``cpu_offload_bytes`` of its decoder layers' weights stay in host memory and are streamed in
    as they run (``offload.WeightStreamer``), unless every weight fits the device as it is (then it says so).
    ``defer_dense``: see ``select_linear_method`` (the caller starts ``DeferredLayouts``)."""
    if device.type == "cuda" and cpu_offload_bytes > 0:
        return _load_offloaded(checkpoint, backend, dtype, device, weights, quantize_activations, tp,
                               cpu_offload_bytes)
    if cpu_offload_bytes > 0:
        logger.warning("--cpu-offload-gb: the weights are in host memory already on %s; nothing to offload",
                       device)
    method = select_linear_method(device, dtype, weights, quantize_activations, defer_dense)
    # the LM head multiplies fp32 activations whatever ``quantize_activations`` says: the logits are what sampling
    # reads, and on the default model int8 activations in the head alone turn its answer to "What is the capital
    # of France?" away from Paris (in the layers they do not); the head is about a third of a step's weight bytes.
    # For the same reason fp8 (which quantizes activations) leaves the head as loaded, as vLLM does
    head_method = select_linear_method(device, dtype, "dense" if weights == "fp8" else weights,
                                       quantize_activations=False, defer_dense=defer_dense)
    model = build_model(checkpoint.hf_config, backend, dtype, device, method, select_fused_ops(device, dtype),
                        head_method, tp)
    mapped = weights in ("gguf-mmap", "dense-mmap")
    if mapped:
        _keep_embeddings_mapped(model, weights)
    kept = kept_block_types(device) if weights in ("gguf", "gguf-mmap") else frozenset()
    if checkpoint.dummy:
        draw_dummy_weights(model)
    else:
        model.load_weights(checkpoint.weights(kept, mapped))
    process_weights_after_loading(model)
    return model.eval()


def _keep_embeddings_mapped(model: CausalLM, weights: str) -> None:
    """Under ``load_format="mmap"`` the embeddings too stay where the file is mapped: a GGUF's in their blocks (a
    step dequantizes the rows it looks up), a safetensors checkpoint's as its tensor."""
    for module in model.modules():
        if isinstance(module, VocabEmbedding):
            if weights == "gguf-mmap":
                module.keep_blocks(ggml_gemm())
            else:
                module.keep_loaded()


def draw_dummy_weights(model: CausalLM, bound: float = DUMMY_WEIGHT_BOUND, seed: int = 0) -> None:
    """Draw every weight uniformly from [-bound, bound], seeded, on its own device (vLLM's dummy format): the
    model then runs at its real shapes and speed, with meaningless but finite outputs. A linear layer whose
    method takes the checkpoint's tensors in a format of its own (quantized at load) is handed them as loaded."""
    generators: dict[torch.device, torch.Generator] = {}

    def fill(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device not in generators:
            generators[tensor.device] = torch.Generator(tensor.device).manual_seed(seed)
        return tensor.uniform_(-bound, bound, generator=generators[tensor.device])

    for layer in model.modules():
        if isinstance(layer, Linear) and layer.weight.numel() == 0:  # a placeholder the method fills at load
            weight = layer.weight
            for shard, rows in (layer.shard_rows() or {None: slice(0, layer.out_features)}).items():
                drawn = fill(torch.empty(rows.stop - rows.start, layer.in_features, dtype=weight.dtype,
                                         device=weight.device))
                layer.method.load_weight(layer, "weight", drawn, shard)
    for parameter in model.parameters():
        fill(parameter.data)


def _load_offloaded(
    checkpoint: Checkpoint, backend: AttentionBackend, dtype: torch.dtype, device: torch.device, weights: str,
    quantize_activations: bool, tp: TensorParallel, cpu_offload_bytes: int,
) -> CausalLM:
    """``load_model`` with weight offload: loaded on the CPU first (the whole model need not fit the device),
    then the offloaded layers' weights pinned there and the rest moved to ``device``."""
    if weights != "dense":
        raise ValueError(f"cpu_offload_gb streams dense weights; the {weights!r} layout is not streamed (use "
                         "quantization='none', or keep the quantized weights resident without cpu_offload_gb)")
    model = load_model(checkpoint, backend, dtype, torch.device("cpu"), weights, quantize_activations, tp)
    free, _ = torch.cuda.mem_get_info(device)
    if model.weight_bytes() < free // 2:  # at least half the device left for activations and KV: no need
        logger.info("--cpu-offload-gb: the weights (%.2f GiB) fit in %s's %.1f GiB free; they stay resident",
                    model.weight_bytes() / 2**30, device, free / 2**30)
    else:
        model.weight_streamer = offload_weights(model.layers, device, cpu_offload_bytes)
    return model.to(device)
