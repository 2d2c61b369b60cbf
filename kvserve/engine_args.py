"""EngineArgs: every engine option, defined once.

``LLM(...)``'s keyword arguments, the engine flags of ``kvserve serve``, ``kvserve bench throughput`` and
``kvserve generate``, their defaults and their help all come from the fields below (``max_num_seqs`` is
``--max-num-seqs``), so a new option is added here and nowhere else. ``create_engine_config`` turns the flat
arguments into the frozen, validated ``EngineConfig`` that the components read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from kvserve.config import (
    ATTENTION_BACKEND_ENV_VAR,
    ATTENTION_BACKENDS,
    DEFAULT_DISK_TIER_GIB,
    DEFAULT_MODEL,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPE_CHOICES,
    GENERATION_CONFIG_CHOICES,
    LOAD_FORMAT_CHOICES,
    LOGPROBS_MODES,
    QUANTIZATION_CHOICES,
    KV_CACHE_DTYPES,
    POOLING_TYPES,
    PREEMPTION_MODES,
    RUNNERS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

# vLLM's dict-valued options (``speculative_config``, ``pooler_config``): each one's keys -> our flat options
_CONFIG_DICTS = {
    "speculative_config": {
        "method": "speculative_method",
        "num_speculative_tokens": "num_speculative_tokens",
        "prompt_lookup_min": "ngram_min",
        "prompt_lookup_max": "ngram_max",
        "model": "draft_model",
    },
    "pooler_config": {"pooling_type": "pooling_type", "normalize": "pooling_normalize"},
}
_CONFIG_DICT_EXAMPLES = {"speculative_config": "{'method': 'ngram'}", "pooler_config": "{'pooling_type': 'MEAN'}"}


def _option(default: Any, help: str, type: type | None = None, choices: Collection[str] | None = None) -> Any:
    """A field that is also a command-line flag; ``type`` None for a boolean ``--x / --no-x`` flag."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


@dataclass(frozen=True)
class EngineArgs:
    """The engine's options as users give them: flat, with the defaults of the configs they fill in."""

    model: str = _option(DEFAULT_MODEL, "a packaged model name (`kvserve models` lists them), a Hugging Face "
                         "directory, a GGUF file, or a Hugging Face Hub id (owner/name)", str)
    dtype: str = _option(ModelConfig.dtype, "weights and activations ('auto': fp32 on CPU, bf16 on CUDA)", str,
                         DTYPE_CHOICES)
    quantization: str = _option(ModelConfig.quantization, "how linear weights are held: 'auto' keeps a GGUF's "
                                "Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks on CPU unless --dtype is given, 'none' dequantizes "
                                "them at load, 'gguf' requires the blocks (on CUDA too: Triton's kernel, the same "
                                "types); 'int8' (per channel) / 'int4' (groups of 128) quantize any "
                                "checkpoint's weights at load (CPU: fp32, the block kernel; CUDA: Triton's "
                                "weight-only kernel, in any --dtype); 'fp8' holds them in e4m3 with a scale "
                                "per channel and multiplies e4m3 activations (torch._scaled_mm: CUDA GPUs of "
                                "compute capability 8.9+, or CPU)", str,
                                QUANTIZATION_CHOICES)
    quantize_activations: bool = _option(ModelConfig.quantize_activations,
                                         "weights kept in blocks (a GGUF's, --quantization int8|int4) multiply "
                                         "activations quantized to int8 in blocks of 32, as llama.cpp does, all but "
                                         "the LM head's (faster; "
                                         "each activation moves by at most half its block's step; opt-in: on the default "
                                         "model it changes greedy answers); off, they stay fp32, equal to the "
                                         "dequantized model up to the order of sums")
    enforce_eager: bool = _option(ModelConfig.enforce_eager,
                                  "run every step op by op; by default a CPU decode step of up to 16 tokens is "
                                  "recorded once per size and replayed without its Python (a step graph)")
    attention_backend: str | None = _option(None, "force an attention backend: 'cpu_paged' (the C kernel: fp32 on "
                                            "CPU), 'triton' (CUDA, or CPU under TRITON_INTERPRET=1), 'torch_ref' "
                                            "(plain PyTorch, the reference); one that cannot run is an error, not "
                                            f"a fallback (default: ${ATTENTION_BACKEND_ENV_VAR}, else the "
                                            "device's best)", str, ATTENTION_BACKENDS)
    chat_template: str | None = _option(None, "a Jinja chat template, or the path of a file holding one, in place "
                                        "of the model's own (as vLLM's flag; for a model that has none, such as "
                                        "the packaged gemma-3-270m)", str)
    generation_config: str = _option(ModelConfig.generation_config, "'auto': the sampling fields of the model's "
                                     "generation_config.json (temperature, top_p, top_k, min_p, "
                                     "repetition_penalty) are the defaults of requests that leave them out and "
                                     "of LLM.generate without sampling params, as in vLLM; 'vllm': "
                                     "SamplingParams' own defaults", str, GENERATION_CONFIG_CHOICES)
    max_logprobs: int = _option(ModelConfig.max_logprobs, "the most alternatives a request may ask for at each "
                                "position (logprobs, top_logprobs, prompt_logprobs; a larger request is a 400 "
                                "naming the field); -1: the whole vocabulary, which a request then asks for with "
                                "-1 (each position's answer holds every token: megabytes of JSON a token on a "
                                "large vocabulary)", int)
    logprobs_mode: str = _option(ModelConfig.logprobs_mode, "what logprob entries hold: 'raw_logprobs' the model's "
                                 "own log probabilities, 'raw_logits' its logits; 'processed_logprobs' / "
                                 "'processed_logits' those after the request's processing, the draw's "
                                 "distribution (allowed tokens, logit_bias, bad_words, min_tokens, penalties, a "
                                 "grammar's mask; then temperature, min_p, top_k, top_p where it samples, not "
                                 "greedily); prompt_logprobs are always the model's own (logits in the logits "
                                 "modes)", str, LOGPROBS_MODES)
    load_format: str = _option(ModelConfig.load_format, "'mmap' (CPU): the weights are used where the file is "
                               "mapped (start-up reads nothing ahead; the pages are shared with other processes "
                               "serving the file; memory about the file's size): a safetensors checkpoint's "
                               "tensors where it stores them in the run's --dtype (a bf16 checkpoint with --dtype "
                               "bfloat16; GEMMs read them as stored, no prepacked copy), or a "
                               "GGUF's quantized blocks, which steps of many tokens multiply too instead of a "
                               "dense copy kept beside them (slower from 4 tokens a step up); refused, naming why, "
                               "where a weight would be copied (a cast, --quantization, tensor parallelism); "
                               "'dummy': random weights of the config's shapes, none read (a directory "
                               "of `kvserve make-checkpoint --config-only` needs it); 'auto' reads the weights "
                               "(a GGUF's blocks kept in memory, with the dense copy)",
                               str, LOAD_FORMAT_CHOICES)
    cpu_offload_gb: float = _option(ModelConfig.cpu_offload_gb, "GiB of the decoder layers' weights to keep in "
                                    "pinned host memory and stream to the GPU as each layer runs, the next "
                                    "layer's copy overlapping this one's compute (CUDA; for models larger than "
                                    "the GPU; ignored, with a note, where the weights fit)", float)
    max_model_len: int | None = _option(None, "context length (default: the model's own); given or not, it is "
                                        "lowered, with a warning, to the longest request the KV cache holds where "
                                        "it holds none this long", int)
    seed: int = _option(ModelConfig.seed, "seeds the sampling of requests that bring no seed of their own", int)
    device: str = _option(EngineConfig.device, "where the model runs ('auto': CUDA when there is one)", str, DEVICES)
    block_size: int = _option(CacheConfig.block_size, "tokens per KV block (a power of two)", int)
    num_kv_blocks: int | None = _option(None, "KV blocks to allocate (wins over the memory options; default: sized "
                                      "from them)", int)
    kv_cache_memory: float | None = _option(None, "GiB for the KV cache (default: 2 GiB on CPU; on CUDA "
                                            "--gpu-memory-utilization of the free memory)", float)
    gpu_memory_utilization: float = _option(CacheConfig.gpu_memory_utilization,
                                            "fraction of the CUDA memory free once the weights are loaded that "
                                            "the KV cache takes (unlike vLLM's, whose fraction is of the whole "
                                            "GPU for the whole instance)", float)
    kv_cache_dtype: str = _option(CacheConfig.kv_cache_dtype,
                                  f"how KV blocks are stored: {' | '.join(KV_CACHE_DTYPES)} ('auto': the model's "
                                  "dtype; the others quantize per token and KV head, holding ~4x / ~4x / ~7x the "
                                  "tokens of fp32 in the same memory)", str, KV_CACHE_DTYPES)
    overlap_scheduling: bool = _option(SchedulerConfig.overlap_scheduling,
                                       "CUDA: schedule and queue the next decode step while one runs, its input "
                                       "ids taken from the sampled tokens on the GPU (SGLang's overlap schedule; "
                                       "a grammar's rows are drawn once the step before is read back; not with "
                                       "speculation, KV tiers, prompt logprobs or tensor parallelism, nor for a "
                                       "step that could admit a waiting request); --no-overlap-scheduling: "
                                       "schedule each step after the one before")
    enable_prefix_caching: bool = _option(CacheConfig.enable_prefix_caching,
                                          "reuse the KV of shared prompt prefixes (radix tree)")
    kv_offload_memory: float | None = _option(None, "GiB of host memory for KV blocks the device pool evicts (a "
                                              "prefix hit on one loads it back instead of recomputing it) and, "
                                              "with --preemption-mode swap, preempted requests' KV (default: no host "
                                              "tier)", float)
    kv_offload_dir: str | None = _option(None, "a directory for a disk tier of KV blocks, written as they are "
                                         "computed: it outlives restarts and can be shared by servers of the same "
                                         "model (a block is used only if verified; staged in 0.25 GiB of host memory "
                                         "unless --kv-offload-memory sets it; default: no disk tier)", str)
    kv_offload_disk: float | None = _option(None, f"GiB the disk tier's directory may fill, least recently used out "
                                            f"first, shared by the servers on it (default {DEFAULT_DISK_TIER_GIB:g}; "
                                            "needs --kv-offload-dir)", float)
    tensor_parallel_size: int = _option(ParallelConfig.tensor_parallel_size,
                                        "split every layer over this many processes (attention heads, the MLP's "
                                        "columns and the vocabulary; KV heads split, or replicated where there are "
                                        "fewer than ranks; every rank runs every layer; gloo on CPU, each rank "
                                        "taking its share of the threads; NCCL on CUDA, one GPU each); rank 0 "
                                        "schedules and samples; dense weights and eager steps only",
                                        int)
    distributed_executor_backend: str = _option(ParallelConfig.distributed_executor_backend,
                                                "where tensor-parallel ranks 1 .. N-1 run: 'mp' spawns them on "
                                                "this machine, 'ray' places them as Ray actors (one bundle per "
                                                "rank, all on this node; needs pip install 'kvserve[ray]'; "
                                                "joins RAY_ADDRESS's cluster or starts a local one)", str,
                                                DISTRIBUTED_EXECUTOR_BACKENDS)
    max_num_seqs: int = _option(SchedulerConfig.max_num_seqs, "requests running at once (at most "
                                "--max-num-batched-tokens: each takes a token a step)", int)
    max_num_batched_tokens: int = _option(SchedulerConfig.max_num_batched_tokens,
                                          "tokens per step; longer prompts are prefilled in chunks", int)
    scheduling_policy: str = _option(SchedulerConfig.scheduling_policy,
                                     "order of waiting requests: arrival (fcfs), longest cached prefix first "
                                     "(lpm), or each request's priority, the lowest value first and displacing "
                                     "running requests of higher values (priority)", str, SCHEDULING_POLICIES)
    lpm_aging_steps: int | None = _option(None, f"lpm: requests waiting longer than this many steps go first, in "
                                          f"arrival order (default {SchedulerConfig.lpm_aging_steps})", int)
    preemption_mode: str = _option(SchedulerConfig.preemption_mode,
                                   "a running request preempted for lack of KV blocks: 'recompute' drops its KV "
                                   "and runs its tokens again, 'swap' copies all its KV to the host tier (needs "
                                   "--kv-offload-memory) and loads it back to resume, recomputing only when the "
                                   "host tier has no room", str, PREEMPTION_MODES)
    speculative_method: str | None = _option(None, "speculative decoding: 'ngram' proposes the tokens that "
                                             "followed the latest earlier occurrence of the last n tokens "
                                             "(prompt lookup), 'draft' the greedy tokens of --draft-model; "
                                             "verified exactly by the model; off by default",
                                             str, SPECULATIVE_METHODS)
    draft_model: str | None = _option(None, "draft speculation: a small model with the target's vocabulary (a "
                                      "packaged name, a Hugging Face directory, a GGUF file or a Hub id); its KV "
                                      "takes blocks of the same pool", str)
    num_speculative_tokens: int | None = _option(None, f"speculation: most tokens proposed per request per step "
                                                 f"(default {SpeculativeConfig.num_speculative_tokens})", int)
    ngram_min: int | None = _option(None, f"ngram speculation: shortest n-gram matched (default "
                                    f"{SpeculativeConfig.prompt_lookup_min})", int)
    ngram_max: int | None = _option(None, f"ngram speculation: longest n-gram matched (default "
                                    f"{SpeculativeConfig.prompt_lookup_max})", int)
    enable_lora: bool = _option(LoRAConfig.enable_lora, "serve LoRA adapters (PEFT's format) over the base "
                                "model: a request names one (offline: lora_request; the server: --lora-modules, "
                                "then the request's model)")
    max_loras: int = _option(LoRAConfig.max_loras, "LoRA: the most distinct adapters in one step (a request whose "
                             "adapter would pass it waits)", int)
    max_lora_rank: int = _option(LoRAConfig.max_lora_rank, "LoRA: the highest adapter rank served (a higher one is "
                                 "refused as it loads)", int)
    runner: str = _option(ModelConfig.runner, "which requests are served: 'generate' draws tokens, 'pooling' returns "
                          "the prompt's hidden states (LLM.embed / encode / score, the server's /v1/embeddings, "
                          "/pooling, /score, /rerank), 'auto' both (vLLM's --runner picks one)", str, RUNNERS)
    pooling_type: str = _option(ModelConfig.pooling_type, "how an embedding pools the prompt's final hidden states: "
                                "the last token's (a causal model's summary of its prompt), their mean, or the "
                                "first token's (vLLM's --pooler-config pooling_type)", str, POOLING_TYPES)
    pooling_normalize: bool = _option(ModelConfig.pooling_normalize, "embeddings scaled to unit length unless a "
                                      "request says otherwise (vLLM's --pooler-config normalize)")

    def __post_init__(self) -> None:
        for option in dataclasses.fields(self):
            value = _in_our_spelling(option, getattr(self, option.name))
            _check_kind(option, value)
            object.__setattr__(self, option.name, value)

    @classmethod
    def with_config_dicts(cls, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with vLLM's dict-valued options among them (``speculative_config``, ``pooler_config``; None:
        not given) folded into our flat ones; ValueError where an option given as well says otherwise."""
        merged = {key: value for key, value in options.items() if key not in _CONFIG_DICTS}
        for name in _CONFIG_DICTS:
            if options.get(name) is None:
                continue
            defaults = {option.name: option.default for option in dataclasses.fields(cls)}
            for key, value in cls.config_dict_options(name, options[name]).items():
                if merged.get(key) not in (None, defaults[key], value):  # a command line's default: not given
                    raise ValueError(f"{key}={merged[key]!r} and {name}'s {value!r} disagree: give it one way")
                merged[key] = value
        return merged

    @staticmethod
    def config_dict_options(name: str, config: Any) -> dict[str, Any]:
        """vLLM's dict-valued option ``name`` as our flat options; an unknown key is a ValueError naming it."""
        keys = _CONFIG_DICTS[name]
        if not isinstance(config, dict):
            raise ValueError(f"{name} must be a dict such as {_CONFIG_DICT_EXAMPLES[name]}, got "
                             f"{type(config).__name__}")
        unknown = set(config) - set(keys)
        if unknown:
            raise ValueError(f"{name}: unknown keys {sorted(unknown)}; expected some of {', '.join(keys)}")
        return {keys[key]: value for key, value in config.items()}

    def create_engine_config(self) -> EngineConfig:
        """The frozen configuration; raises ValueError naming the first bad option."""
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
                              quantization=self.quantization, quantize_activations=self.quantize_activations,
                              enforce_eager=self.enforce_eager, load_format=self.load_format,
                              cpu_offload_gb=self.cpu_offload_gb,
                              attention_backend=self.attention_backend or _attention_backend_from_environment(),
                              chat_template=_chat_template_text(self.chat_template),
                              generation_config=self.generation_config, max_logprobs=self.max_logprobs,
                              logprobs_mode=self.logprobs_mode, runner=self.runner, pooling_type=self.pooling_type,
                              pooling_normalize=self.pooling_normalize),
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_offload_memory=self.kv_offload_memory,
                kv_offload_dir=self.kv_offload_dir,
                kv_offload_disk=self.kv_offload_disk,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=self._scheduler_config(),
            speculative=self._speculative_config(),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend),
            lora=self._lora_config(),
            device=self.device,
        )

    def _lora_config(self) -> LoRAConfig:
        """The LoRA options, refused by name where LoRA is off (they would be silently ignored)."""
        tuned = [name for name in ("max_loras", "max_lora_rank")
                 if getattr(self, name) != getattr(LoRAConfig, name)]
        if tuned and not self.enable_lora:
            raise ValueError(f"{', '.join(tuned)} tune LoRA, which is off: give enable_lora too (--enable-lora)")
        return LoRAConfig(self.enable_lora, self.max_loras, self.max_lora_rank)

    def _scheduler_config(self) -> SchedulerConfig:
        """The scheduling options; lpm's aging refused by name under fcfs, where it would be silently ignored."""
        if self.lpm_aging_steps is not None and self.scheduling_policy != "lpm":
            raise ValueError(f"lpm_aging_steps tunes scheduling_policy='lpm', not {self.scheduling_policy!r}")
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling_policy=self.scheduling_policy,
            lpm_aging_steps=_given_or(self.lpm_aging_steps, SchedulerConfig.lpm_aging_steps),
            preemption_mode=self.preemption_mode,
            overlap_scheduling=self.overlap_scheduling,
        )

    def _speculative_config(self) -> SpeculativeConfig:
        """The speculation options given, each refused by name where the method given does not use it (vLLM
        refuses them so too: a speculation option with speculation off would be silently ignored)."""
        ngram = {"ngram_min": self.ngram_min, "ngram_max": self.ngram_max}
        given = [name for name, value in {"num_speculative_tokens": self.num_speculative_tokens, **ngram}.items()
                 if value is not None]
        if self.speculative_method is None and given:
            raise ValueError(f"{', '.join(given)} tune speculation, which is off: give speculative_method too "
                             "(--speculative-method ngram|draft)")
        if self.speculative_method == "draft" and (unused := [name for name in ngram if name in given]):
            raise ValueError(f"{', '.join(unused)} tune speculative_method='ngram', not 'draft'")
        defaults = SpeculativeConfig()
        return SpeculativeConfig(
            method=self.speculative_method,
            num_speculative_tokens=_given_or(self.num_speculative_tokens, defaults.num_speculative_tokens),
            prompt_lookup_min=_given_or(self.ngram_min, defaults.prompt_lookup_min),
            prompt_lookup_max=_given_or(self.ngram_max, defaults.prompt_lookup_max),
            model=self.draft_model,
        )

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, *, skip: Collection[str] = (), model_flag: bool = False
    ) -> None:
        """Add a flag per option to ``parser`` (MODEL positional unless ``model_flag``); ``skip`` leaves out
        options whose flag the command already uses for something of its own."""
        group = parser.add_argument_group("engine")
        for option in dataclasses.fields(cls):
            if option.name in skip:
                continue
            meta = option.metadata
            kwargs: dict[str, Any] = {"default": option.default, "help": _help_with_default(option)}
            if meta["type"] is None:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs.update(type=meta["type"], choices=meta["choices"])
            if option.name == "model" and not model_flag:
                action = group.add_argument("model", nargs="?", **kwargs)
            else:
                action = group.add_argument("--" + option.name.replace("_", "-"), **kwargs)
            action.help = kwargs["help"]  # as written here, whatever the action adds to it
        group.add_argument("--speculative-config", type=_json_object, default=None,
                           help="vLLM's speculation options as JSON, e.g. '{\"method\": \"ngram\", "
                                "\"num_speculative_tokens\": 4}' (keys: "
                                + ", ".join(_CONFIG_DICTS["speculative_config"])
                                + "; the --speculative-method flags otherwise)")
        group.add_argument("--pooler-config", type=_json_object, default=None,
                           help="vLLM's pooling options as JSON, e.g. '{\"pooling_type\": \"MEAN\"}' (keys: "
                                + ", ".join(_CONFIG_DICTS["pooler_config"]) + "; the --pooling-type flags otherwise)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options parsed by a parser that ``add_cli_args`` filled (``--speculative-config`` and
        ``--pooler-config`` folded in); skipped ones keep their defaults unless the command's own flag of that name
        set them."""
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        options.update({name: getattr(args, name, None) for name in _CONFIG_DICTS})
        return cls(**cls.with_config_dicts(options))


# What each option's values must be, by its flag's type (None: a boolean flag)
_KINDS: dict[type | None, tuple[Callable[[Any], bool], str]] = {
    None: (lambda value: isinstance(value, bool), "True or False"),
    int: (lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"),
    float: (lambda value: isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"),
    str: (lambda value: isinstance(value, str), "a string"),
}


# Options whose default in vLLM is None, "the engine decides": a vLLM script's explicit None means our default (a
# seed of None is vLLM V1's 0 too)
_NONE_MEANS_DEFAULT = frozenset({"quantization", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                                 "seed", "block_size", "distributed_executor_backend"})


def _in_our_spelling(option: dataclasses.Field, value: Any) -> Any:
    """A value as vLLM's ``LLM`` takes it, spelled as ours: None where vLLM's default is None, a ``torch.dtype``
    by its name."""
    if value is None and option.name in _NONE_MEANS_DEFAULT:
        return option.default
    if option.name == "dtype" and type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    return value


def _check_kind(option: dataclasses.Field, value: Any) -> None:
    """ValueError naming the option unless ``value`` is of its kind (None where its default is None): a string
    where a number belongs failed deep inside a config's checks with a TypeError naming nothing."""
    if value is None and option.default is None:
        return
    accepts, described = _KINDS[option.metadata["type"]]
    if not accepts(value):
        raise ValueError(f"{option.name} must be {described}, got {type(value).__name__} {value!r}")


def _help_with_default(option: dataclasses.Field) -> str:
    """The option's help with its default appended; an option whose default is None says in its help what it
    does when not given."""
    text = option.metadata["help"].replace("%", "%%")  # argparse formats help with %
    if option.default is None:
        return text
    shown = ("on" if option.default else "off") if option.metadata["type"] is None else option.default
    return f"{text} (default: {shown})"


def _json_object(text: str) -> Any:
    """A flag's JSON value (``--speculative-config``), or argparse's error saying why it is none."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None


def _attention_backend_from_environment() -> str | None:
    """``$KVSERVE_ATTENTION_BACKEND``, or None; a value that names no backend is a ValueError naming the
    variable (no flag was given to name)."""
    value = os.environ.get(ATTENTION_BACKEND_ENV_VAR) or None
    if value is not None and value not in ATTENTION_BACKENDS:
        raise ValueError(f"${ATTENTION_BACKEND_ENV_VAR}={value!r} names no attention backend; expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    return value


def _given_or(value: int | None, default: int) -> int:
    return default if value is None else value


def _chat_template_text(value: str | None) -> str | None:
    """``--chat-template``'s text: the file it names, or the template itself (as vLLM reads it)."""
    if value is None or not value.strip():
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
