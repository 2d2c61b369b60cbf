"""Engine configuration: frozen dataclasses, validated once in ``__post_init__``.

Each component takes the narrow config it needs: the scheduler a ``SchedulerConfig``, the KV manager a
``CacheConfig``, the model runner a ``ModelConfig`` plus the device. Users give options through
``kvserve.engine_args.EngineArgs``, which builds these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.extras import check_ray_installed
from kvserve.kv.encodings import KV_ENCODING_NAMES
from kvserve.sampling_params import is_seed

DEFAULT_MODEL = "smollm2-135m-instruct"
SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
SPECULATIVE_METHODS = ("ngram", "draft")
PREEMPTION_MODES = ("recompute", "swap")
DEFAULT_DISK_TIER_GIB = 16.0
# the shortest context that serves a request: a prompt token and the token every request draws (shorter, a server
# said it was healthy and refused every request)
MIN_MODEL_LEN = 2
_MIN_MODEL_LEN_WHY = "max_model_len must be >= 2 (a prompt token and the token a request draws), got {}"

# --dtype's names -> the torch dtype each means (``torch.<name>``, ``kvserve.device.parse_dtype``): names, not
# dtypes, so that the configuration and the command line import no torch
TORCH_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
DTYPE_CHOICES = ("auto", *TORCH_DTYPE_NAMES)
LOAD_FORMAT_CHOICES = ("auto", "mmap", "dummy")
# where the sampling defaults come from (vLLM's --generation-config): the model's generation_config.json, or none
GENERATION_CONFIG_CHOICES = ("auto", "vllm")
# what logprob entries hold (vLLM's --logprobs-mode): the model's own distribution (raw) or the one the request's
# processing leaves (processed), as log probabilities or as the logits themselves; the first is the default
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# attention backends a run may force (kvserve/attention/selector.py); by default the device's best is picked.
# ``EngineArgs`` reads the environment variable where no backend is given (tests and benchmarks set it per run)
ATTENTION_BACKENDS = ("cpu_paged", "torch_ref", "triton")
ATTENTION_BACKEND_ENV_VAR = "KVSERVE_ATTENTION_BACKEND"
# how the weights are held: auto keeps a GGUF's blocks where a kernel reads them (CPU, fp32 activations, dtype not
# forced); none dequantizes at load; gguf insists on the blocks; int8 / int4 quantize every checkpoint's linear
# weights at load (weight-only unless quantize_activations); fp8 holds them in e4m3 and quantizes activations per
# token too (CUDA of compute capability 8.9+, or CPU)
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "int4", "fp8")
KV_CACHE_DTYPES = ("auto", *KV_ENCODING_NAMES)  # "auto": the model's dtype, unquantized
# which requests the engine serves (vLLM's --runner): "generate" draws tokens, "pooling" returns hidden states
# (``PoolingParams``), "auto" both (a generative model's hidden states are the embeddings vLLM converts it to)
RUNNERS = ("auto", "generate", "pooling")
# How a pooling request's "embed" pools its prompt's final hidden states (vLLM's pooling types): the last token's (a
# causal model's own summary of the prompt, vLLM's default for a converted generative model), their mean, or the
# first token's
POOLING_TYPES = ("LAST", "MEAN", "CLS")


def check_dtype_name(name: str) -> None:
    """Refuse a ``--dtype`` that is neither ``auto`` nor one of ``TORCH_DTYPE_NAMES``."""
    if name != "auto" and name not in TORCH_DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of auto, {', '.join(sorted(TORCH_DTYPE_NAMES))}")


def check_device_name(device: str) -> None:
    """Refuse a device that is not ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (whether it is there is
    ``kvserve.device.resolve_device``'s to say)."""
    if device not in DEVICES and not device.startswith("cuda:"):
        raise ValueError(f"unknown device {device!r}; expected cpu, cuda, cuda:N or auto")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: ``model`` is resolved by ``kvserve.model.sources``."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    quantization: str = "auto"
    # weights kept in blocks multiply int8 activations (llama.cpp's numerics): opt-in, since on the default model
    # they change greedy answers (it no longer answers Paris to the capital of France)
    quantize_activations: bool = False
    # every step op by op from Python: no CPU step graphs (kvserve/worker/cpu_graph.py)
    enforce_eager: bool = False
    # "mmap" (CPU): the weights are used where the file is mapped, the only copy of them: a GGUF's blocks (no dense
    # layout), a safetensors checkpoint's tensors (stored in the model's dtype);
    # "dummy": random weights of the config's shapes, nothing read (speed at real sizes without the weights)
    load_format: str = "auto"
    cpu_offload_gb: float = 0.0  # GiB of decoder-layer weights kept in host memory and streamed in (CUDA)
    # a GGUF's dense copies for steps of many tokens are laid out on a thread after start-up, those steps
    # multiplying the blocks meanwhile (kvserve/model/deferred_layout.py); ``kvserve serve`` sets it
    dense_layouts_in_background: bool = False
    attention_backend: str | None = None  # one of ATTENTION_BACKENDS, forced; None: the device's best
    chat_template: str | None = None  # a Jinja chat template in place of the tokenizer's; None: the tokenizer's
    generation_config: str = "auto"  # one of GENERATION_CONFIG_CHOICES
    # the most alternatives a request's logprobs and prompt_logprobs may ask for at a position; -1: the vocabulary's
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES
    runner: str = "auto"  # one of RUNNERS
    pooling_type: str = "LAST"  # one of POOLING_TYPES
    pooling_normalize: bool = True  # pooled vectors scaled to unit length unless a request says otherwise

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What requests the engine serves (vLLM's task names): "generate", and the pooling tasks."""
        generates = ("generate",) if self.runner != "pooling" else ()
        return generates + (("embed", "token_embed") if self.runner != "generate" else ())

    def __post_init__(self) -> None:
        for name, choices in (("runner", RUNNERS), ("pooling_type", POOLING_TYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; expected one of {', '.join(choices)}")
        tuned = [name for name in ("pooling_type", "pooling_normalize")
                 if getattr(self, name) != getattr(ModelConfig, name)]
        if tuned and self.runner == "generate":  # else silently ignored: no pooling request is served
            raise ValueError(f"{', '.join(tuned)} tune pooling requests, which runner='generate' does not serve "
                             "(--runner auto or pooling)")
        if not (self.cpu_offload_gb >= 0 and math.isfinite(self.cpu_offload_gb * 2**30)):
            raise ValueError(f"cpu_offload_gb must be a finite number of GiB >= 0, got {self.cpu_offload_gb}")
        check_dtype_name(self.dtype)
        if self.load_format not in LOAD_FORMAT_CHOICES:
            raise ValueError(f"unknown load_format {self.load_format!r}; expected one of "
                             f"{', '.join(LOAD_FORMAT_CHOICES)}")
        if self.generation_config not in GENERATION_CONFIG_CHOICES:
            raise ValueError(f"unknown generation_config {self.generation_config!r}; expected one of "
                             f"{', '.join(GENERATION_CONFIG_CHOICES)}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"unknown quantization {self.quantization!r}; expected one of "
                             f"{', '.join(QUANTIZATION_CHOICES)}")
        if self.max_model_len is not None and self.max_model_len < MIN_MODEL_LEN:
            raise ValueError(_MIN_MODEL_LEN_WHY.format(self.max_model_len))
        if not is_seed(self.seed):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention_backend!r}; expected one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the whole vocabulary) or >= 0, got {self.max_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"unknown logprobs_mode {self.logprobs_mode!r}; expected one of "
                             f"{', '.join(LOGPROBS_MODES)}")


def _check_gib(name: str, gib: float | None) -> None:
    """A memory budget is a finite number of GiB above 0 (NaN passed ``<= 0`` and failed later, naming nothing),
    and its bytes too (1e300 GiB overflows to infinity)."""
    if gib is not None and not (gib > 0 and math.isfinite(gib * 2**30)):
        raise ValueError(f"{name} must be a finite number of GiB > 0, got {gib}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing. ``num_kv_blocks`` wins over ``kv_cache_memory`` (GiB; default 2 GiB off CUDA), which
    wins over ``gpu_memory_utilization`` (the fraction of free CUDA memory to use)."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    # GiB of host memory for blocks evicted from the device pool, and the KV of requests preempted by swap
    kv_offload_memory: float | None = None
    kv_offload_dir: str | None = None  # a directory for the disk tier (persistent, shareable between servers)
    kv_offload_disk: float | None = None  # GiB the disk tier may fill (DEFAULT_DISK_TIER_GIB); oldest blocks go first

    @property
    def offloads_kv(self) -> bool:
        return self.kv_offload_memory is not None or self.kv_offload_dir is not None

    @property
    def disk_tier_bytes(self) -> int:
        gib = DEFAULT_DISK_TIER_GIB if self.kv_offload_disk is None else self.kv_offload_disk
        return int(gib * 2**30)

    def __post_init__(self) -> None:
        self._check_offload()
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        _check_gib("kv_cache_memory", self.kv_cache_memory)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")

    def _check_offload(self) -> None:
        _check_gib("kv_offload_memory", self.kv_offload_memory)
        _check_gib("kv_offload_disk", self.kv_offload_disk)
        if self.kv_offload_disk is not None and self.kv_offload_dir is None:
            raise ValueError("kv_offload_disk sizes the disk tier, which kv_offload_dir turns on: give the directory "
                             "too, or drop kv_offload_disk")
        if self.kv_offload_dir is not None and not self.kv_offload_dir:
            raise ValueError("kv_offload_dir must name a directory")
        if self.kv_offload_dir is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir keeps prefix-cache blocks: it needs prefix caching on (drop "
                             "--no-enable-prefix-caching)")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget scheduling. ``max_model_len`` is filled in from the model once it is known."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    # Waiting requests: "fcfs" in arrival order, or "lpm" (longest cached prefix first, SGLang's policy)
    # with requests waiting over ``lpm_aging_steps`` steps served first, in arrival order, so none starves; or
    # "priority" (vLLM's): by each request's priority, the lowest value first, then arrival, a request of a lower
    # value displacing running ones of higher values (``Scheduler``'s docstring). Only "priority" takes a request
    # priority other than 0.
    scheduling_policy: str = "lpm"
    lpm_aging_steps: int = 64
    # A running request preempted for lack of KV blocks: "recompute" drops its KV and runs its tokens again;
    # "swap" copies its KV to the host tier (``CacheConfig.kv_offload_memory``) and loads it back to resume.
    preemption_mode: str = "recompute"
    # On CUDA (one rank), a decode step scheduled and queued while the one before it runs, its input ids taken
    # from that step's sampled tokens on the device (``Scheduler.schedule_continuation``); off: after it.
    overlap_scheduling: bool = True
    # With LoRA adapters (``LoRAConfig.max_loras``): the most distinct adapters among the running requests; None:
    # LoRA is off
    max_loras: int | None = None

    @property
    def max_running(self) -> int:
        """Requests running at once: ``max_num_seqs``, but no more than a step's token budget, as each running
        request takes a token a step (past the budget the last ones got none for as long as those ahead of them
        ran: an n = 64 request under a 32-token budget left half its samples holding their KV, idle, for their
        whole generation; vLLM refuses such a pair, kvserve runs it with as many seats as the budget)."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.lpm_aging_steps < 1:
            raise ValueError(f"lpm_aging_steps must be >= 1, got {self.lpm_aging_steps}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < MIN_MODEL_LEN:
            raise ValueError(_MIN_MODEL_LEN_WHY.format(self.max_model_len))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, off while ``method`` is None. ``ngram`` (prompt lookup) proposes up to
    ``num_speculative_tokens`` tokens that followed the latest earlier occurrence of the request's last n
    tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``. ``draft`` proposes the greedy
    continuation of a small model, ``model`` (resolved like the target's), that shares the target's vocabulary."""

    method: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model of method "draft"

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative_method='draft' needs a draft model: give --draft-model PATH (or "
                             "speculative_config={'method': 'draft', 'model': PATH})")
        if self.model is not None and self.method != "draft":
            raise ValueError(f"draft_model is used by speculative_method='draft' only, got method={self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min < 1:
            raise ValueError(f"ngram_min (prompt_lookup_min) must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"ngram_max (prompt_lookup_max) must be >= ngram_min ({self.prompt_lookup_min}), "
                             f"got {self.prompt_lookup_max}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the model's layers and KV heads split over ``tensor_parallel_size`` processes
    (``kvserve/worker/parallel.py``), ranks 1 .. N-1 spawned on this machine (``mp``) or placed as Ray actors
    (``ray``, ``kvserve/worker/ray_workers.py``). With one rank there is nothing to place: ``ray`` is accepted,
    as vLLM accepts it, and the rank runs in the engine's process."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.tensor_parallel_size > 1:
            check_ray_installed("--distributed-executor-backend ray")  # before the checkpoint loads


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters over the base model (vLLM's options): off unless ``enable_lora``. ``max_loras``: the most
    distinct adapters in one step (the scheduler holds back a request whose adapter would pass it);
    ``max_lora_rank``: the highest rank an adapter may have (a higher one is refused as it loads)."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    device: str = "auto"

    def __post_init__(self) -> None:
        check_device_name(self.device)
        self._check_host_tier()
        self._check_tensor_parallel()
        self._check_lora()
        if self.model.runner == "pooling" and self.speculative.enabled:  # no request would ever speculate
            raise ValueError(f"speculative_method={self.speculative.method!r} with runner='pooling' does nothing: "
                             "pooling requests draw no tokens to speculate on (use --runner auto or generate)")
        if self.speculative.method == "draft" and self.cache.offloads_kv:
            raise ValueError("speculative_method='draft' does not combine with kv_offload_memory / kv_offload_dir: "
                             "the KV tiers move the target's blocks only, not the draft model's")

    def _check_host_tier(self) -> None:
        """The host tier keeps prefix-cache blocks, and the KV of requests preempted by swap: one of the two
        must use it, and swap needs it (no default size is guessed)."""
        swaps = self.scheduler.preemption_mode == "swap"
        if swaps and self.cache.kv_offload_memory is None:
            raise ValueError("preemption_mode='swap' copies preempted requests' KV to the host tier: it needs "
                             "kv_offload_memory (--preemption-mode swap --kv-offload-memory GiB)")
        if self.cache.kv_offload_memory is not None and not (swaps or self.cache.enable_prefix_caching):
            raise ValueError("kv_offload_memory keeps prefix-cache blocks, or with --preemption-mode swap preempted "
                             "requests' KV: without prefix caching it needs preemption_mode='swap' (or drop "
                             "--no-enable-prefix-caching)")

    def _check_lora(self) -> None:
        """What LoRA adapters do not combine with yet: a draft model (it has no adapter: its drafts would be the
        base model's, verified by the adapted one, right but mostly rejected)."""
        if not self.lora.enable_lora:
            return
        if self.speculative.method == "draft":
            raise ValueError("enable_lora with speculative_method='draft' is not supported: the draft model runs "
                             "without the requests' adapters (speculative_method='ngram' works)")

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism does not combine with yet: quantized weights (GGUF's blocks, int8 / int4, fp8),
        int8 activations, weight offload, the KV tiers and draft speculation. (``quantization="auto"`` dequantizes
        a GGUF instead; CPU step graphs are left off.)"""
        size = self.parallel.tensor_parallel_size
        if size == 1:
            return
        if self.model.quantization in ("gguf", "int8", "int4", "fp8"):
            raise ValueError(f"tensor_parallel_size={size} with quantization={self.model.quantization!r} is not "
                             "supported: tensor-parallel layers hold dense weights (use quantization='none' or "
                             "'auto', which dequantizes a GGUF)")
        if self.model.quantize_activations:
            raise ValueError(f"tensor_parallel_size={size} with quantize_activations is not supported: "
                             "tensor-parallel layers hold dense weights, and int8 activations multiply quantized ones")
        if self.model.cpu_offload_gb:
            raise ValueError(f"tensor_parallel_size={size} with cpu_offload_gb is not supported: the ranks would "
                             "each stream their own shards (not built)")
        if self.cache.offloads_kv:
            raise ValueError(f"tensor_parallel_size={size} with kv_offload_memory / kv_offload_dir is not "
                             "supported yet: the KV tiers hold whole blocks of one process")
        if self.speculative.method == "draft":
            raise ValueError(f"tensor_parallel_size={size} with speculative_method='draft' is not supported yet: "
                             "the draft model runs in rank 0 alone (speculative_method='ngram' works)")
