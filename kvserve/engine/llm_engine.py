"""LLMEngine: input processor -> engine core -> output processor. Tokenizer-aware, device-unaware.

The server drives it through ``add_request / abort_request / step``; the offline ``LLM`` loops ``step``.

At start-up it loads the model, chooses its KV cache groups (sliding-window layers apart, unless a feature that
keeps one block table per request is on: a draft model, or the prefix cache on a model without one
full-attention group; then one table, said once in the log; tensor parallelism's workers get the same layout)
and sizes the KV pool (``kv_budget.py``). On CUDA with one rank it overlaps steps: ``overlap_outputs`` (a step
returns the previous step's outputs, detokenized while the device runs this one) and ``overlap_scheduling``
(``--no-overlap-scheduling`` turns it off: the next decode step launched behind the running one where it can be,
``EngineCore.launch_continuation``). ``stats()`` reports, among others, the blocks held by window groups
(``kv_blocks_windowed``) and by full ones (``kv_blocks_full``).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Iterable

import torch

from kvserve.config import MIN_MODEL_LEN, EngineConfig
from kvserve.device import parse_dtype, resolve_device
from kvserve.engine.core import EngineCore, PendingStep
from kvserve.engine.kv_budget import check_fits_host_memory, num_kv_blocks_for
from kvserve.engine.input_processor import InputProcessor, ProcessedPrompt, PromptInput
from kvserve.engine.lora_adapters import LoRAAdapters
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.profiler import StepProfiler
from kvserve.engine.sleep_mode import KV_CACHE, WEIGHTS, EngineAsleep, released_by, woken_by
from kvserve.kv.groups import KVCacheGroups
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.quant import kv_cache_dtype
from kvserve.kv.disk_tier import BlockFormat
from kvserve.kv.tiers import DEFAULT_STAGING_GIB, TieredStore
from kvserve.lora_request import LoRARequest
from kvserve.model.loader import Checkpoint, load_checkpoint
from kvserve.model.registry import check_shardable
from kvserve.model.weight_format import check_quantize_activations, weight_format
from kvserve.sample.grammar import StructuredOutputCompiler
from kvserve.model.sources import resolve_model
from kvserve.outputs import FinishReason, PoolingRequestOutput, RequestOutput
from kvserve.pooling_params import PoolingParams, UnsupportedTask
from kvserve.request import Request
from kvserve.sampling_params import InvalidParameter, SamplingParams
from kvserve.sched.output import EngineOutput, SchedulerOutput
from kvserve.sched.scheduler import Scheduler
from kvserve.worker.draft_model import DraftModel
from kvserve.worker.kv_transfers import HostCopies
from kvserve.spec.policy import SpeculationPolicy
from kvserve.worker.model_runner import ModelRunner, RunnerOptions
from kvserve.worker.parallel import WorkerGroup, WorkerSpec, start_workers
from kvserve.worker.ray_workers import start_ray_workers

logger = logging.getLogger(__name__)
WARM_UP_REQUEST_ID = "kvserve-warm-up"


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(resolve_device(config.device))
        self.dtype = parse_dtype(config.model.dtype, self.device.type)
        self.location = resolve_model(config.model.model)
        checkpoint = load_checkpoint(self.location, self.dtype, config.model.load_format)
        self.max_model_len = self._max_model_len(checkpoint.max_model_len)
        self.tokenizer = checkpoint.tokenizer
        self.eos_token_ids = checkpoint.eos_token_ids
        self.default_sampling_params = self._default_sampling_params(checkpoint)
        tp_size = config.parallel.tensor_parallel_size
        self.weight_format = weight_format(
            config.model.quantization, checkpoint, self.device, self.dtype, dtype_forced=config.model.dtype != "auto",
            tensor_parallel_size=tp_size, load_format=config.model.load_format,
        )
        if config.model.quantize_activations:
            check_quantize_activations(self.weight_format, self.device)
        self.runner_options = self._runner_options()
        vocab_size = checkpoint.hf_config.vocab_size
        structured = StructuredOutputCompiler(self.tokenizer, vocab_size, sorted(self.eos_token_ids))
        workers = self._start_workers(checkpoint, tp_size)
        try:
            runner = ModelRunner(checkpoint, self.dtype, self.device, self.runner_options, structured=structured,
                                 draft=self._draft_model(vocab_size), peers=workers)
            self.core = self._build_core(runner)
            self.lora_adapters = LoRAAdapters(config.lora, runner, self.core.scheduler.num_requests_by_adapter)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        self.input_processor = InputProcessor(self.tokenizer, vocab_size, self.max_model_len, structured,
                                              config.model.chat_template, config.model.max_logprobs)
        self.output_processor = OutputProcessor(self.tokenizer)
        # On CUDA a step's outputs are processed while the device runs the next step (see ``step``)
        self.overlap_outputs = self.device.type == "cuda" and tp_size == 1
        # and, within that loop, the next step scheduled and queued before this one's tokens are read back
        self.overlap_scheduling = self.overlap_outputs and config.scheduler.overlap_scheduling
        self._held: list[EngineOutput] = []  # the last step's outputs, not yet processed (overlap_outputs)
        self._next: PendingStep | None = None  # a step launched ahead of its turn (overlap_scheduling)
        self.profiler = StepProfiler()
        self.asleep: frozenset[str] = frozenset()  # what sleep mode released (``sleep_mode``): nothing while awake
        self._log_start(runner)

    def _runner_options(self) -> RunnerOptions:
        """How the runner (and every tensor-parallel worker's) holds the model and its KV cache."""
        model, cache = self.config.model, self.config.cache
        return RunnerOptions(
            cache.block_size, model.seed, self.weight_format, cache.kv_cache_dtype, model.quantize_activations,
            model.enforce_eager, int(model.cpu_offload_gb * 2**30), model.dense_layouts_in_background,
            model.attention_backend, model.logprobs_mode, model.pooling_type,
        )

    def _default_sampling_params(self, checkpoint: Checkpoint) -> SamplingParams:
        """What a request leaves out (the server) or leaves out whole (``LLM.generate`` without sampling params)
        gets: with ``generation_config="auto"`` the sampling fields of the model's generation_config.json, as vLLM
        (since 0.8) fills them in, said at start-up; a field out of range there is a ValueError naming the file."""
        defaults = checkpoint.sampling_defaults if self.config.model.generation_config == "auto" else {}
        if not defaults:
            return SamplingParams()
        try:
            params = SamplingParams(**defaults)
        except ValueError as error:
            raise ValueError(f"{self.location.name}: generation_config.json: {error} (--generation-config vllm "
                             "ignores the file's sampling fields)") from None
        logger.info("sampling defaults from the model's generation_config.json: %s (requests that set a "
                    "field keep theirs; --generation-config vllm ignores the file)",
                    ", ".join(f"{name}={value}" for name, value in defaults.items()))
        return params

    def _log_start(self, runner: ModelRunner) -> None:
        """What runs, said once: the model and its memory, then how the engine serves it."""
        tp_size = self.config.parallel.tensor_parallel_size
        logger.info(
            "%s on %s (%s weights, %.1f MB%s, %s activations), %d KV blocks of %d tokens (%s)%s",
            self.location.name, self.device, runner.weights_format(), runner.weight_bytes / 1e6,
            " before the dense layouts under way" if runner.layouts is not None else "", runner.activations_format,
            self.num_kv_blocks, self.config.cache.block_size, runner.kv_cache_dtype.name,
            f", tensor parallel over {tp_size} ranks (KV blocks per rank)" if tp_size > 1 else "",
        )
        logger.info("attention %s; %s", type(runner.backend).__name__, "; ".join(self._serving_settings()))

    def _serving_settings(self) -> list[str]:
        cache, sched, spec = self.config.cache, self.config.scheduler, self.config.speculative
        settings = [f"prefix caching {'on' if cache.enable_prefix_caching else 'off'}"]
        if cache.kv_offload_memory is not None:
            settings.append(f"host KV tier {cache.kv_offload_memory:g} GiB")
        if cache.kv_offload_dir is not None:
            settings.append(f"disk KV tier {cache.kv_offload_dir} (up to {cache.disk_tier_bytes / 2**30:g} GiB)")
        if spec.method is not None:
            settings.append(f"{spec.method} speculation of up to {spec.num_speculative_tokens} tokens")
        if self.config.lora.enable_lora:
            settings.append(f"LoRA adapters of rank up to {self.config.lora.max_lora_rank}, "
                            f"{self.config.lora.max_loras} a step (steps with adapters run eagerly)")
        settings.append(f"steps of up to {sched.max_running} sequences and {sched.max_num_batched_tokens} tokens, "
                        f"{sched.scheduling_policy} scheduling, preemption by {sched.preemption_mode}")
        return settings

    def _start_workers(self, checkpoint: Checkpoint, size: int) -> WorkerGroup | None:
        """Ranks 1 .. size - 1 of tensor parallelism (none for one rank), local processes or Ray actors, each
        loading its part of the model meanwhile (once the model's shapes are known to split)."""
        backend = self.config.parallel.distributed_executor_backend
        if size == 1:
            if backend == "ray":
                logger.info("distributed_executor_backend='ray' with tensor_parallel_size=1: nothing to place, "
                            "the one rank runs in this process")
            return None
        check_shardable(checkpoint.hf_config, size)
        cpu_threads = max(1, torch.get_num_threads() // size)
        spec = WorkerSpec(self.location, self.dtype, self.device.type, self.runner_options, cpu_threads,
                          self.config.model.load_format)
        if backend == "ray":
            return start_ray_workers(spec, size, self.device)
        return start_workers(spec, size)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and the KV tiers' I/O threads (the engine cannot step
        afterwards), and write the trace of a profile still recording; idempotent."""
        if self.profiler.is_profiling:
            self.profiler.stop()
        self.core.runner.close()
        if (store := self.core.kv_manager.store) is not None:
            store.close()

    def check_workers(self) -> None:
        """Raise ``TensorParallelError`` naming a tensor-parallel worker that died or failed (none: nothing)."""
        self.core.runner.peers.check_alive()

    def _max_model_len(self, model_limit: int) -> int:
        asked = self.config.model.max_model_len
        if asked is not None and asked > model_limit:
            # vLLM raises a yarn or linear rope scaling's limit by its factor; kvserve reads the config's figure,
            # which a user who means the scaled length sets (the rope tables grow past it)
            raise ValueError(f"max_model_len={asked} is over the model's context length ({model_limit}, its "
                             "max_position_embeddings; a rope scaling does not raise it here: set that to serve "
                             "longer)")
        if asked is None and model_limit < MIN_MODEL_LEN:
            raise ValueError(f"the model's context length (its max_position_embeddings) is {model_limit}: it holds "
                             "no request of a prompt token and the token a request draws")
        return asked or model_limit

    def _draft_model(self, vocab_size: int) -> DraftModel | None:
        """The draft model of ``--speculative-method draft``: refused (ValueError) unless it shares the target's
        tokenizer (every token under the same id; the embeddings may be padded to other sizes, as Qwen2.5 0.5B's
        are against 7B's) and covers its context length."""
        config = self.config
        if config.speculative.method != "draft":
            return None
        assert config.speculative.model is not None
        location = resolve_model(config.speculative.model)
        checkpoint = load_checkpoint(location, self.dtype, config.model.load_format)
        target_tokens, draft_tokens = self.tokenizer.get_vocab(), checkpoint.tokenizer.get_vocab()
        if draft_tokens != target_tokens:
            differ = len(draft_tokens.items() ^ target_tokens.items())
            raise ValueError(f"draft model {location.name!r} does not share the target's tokenizer ({differ} token "
                             f"entries differ): a draft must share the target's vocabulary")
        if checkpoint.max_model_len < self.max_model_len:
            raise ValueError(f"draft model {location.name!r} covers {checkpoint.max_model_len} positions, under "
                             f"max_model_len={self.max_model_len}: lower --max-model-len")
        weights = weight_format(config.model.quantization, checkpoint, self.device, self.dtype,
                                dtype_forced=config.model.dtype != "auto", load_format=config.model.load_format)
        kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        return DraftModel(checkpoint, self.dtype, self.device, config.cache.block_size, kv_dtype, vocab_size, weights,
                          config.model.quantize_activations, config.model.enforce_eager,
                          config.model.attention_backend)

    def _build_core(self, runner: ModelRunner) -> EngineCore:
        lora = self.config.lora
        sched_config = dataclasses.replace(self.config.scheduler, max_model_len=self.max_model_len,
                                           max_loras=lora.max_loras if lora.enable_lora else None)
        block_size = self.config.cache.block_size
        groups = self._kv_groups(runner)
        runner.use_kv_groups(groups)
        # with the prefix cache on, blocks no running request holds keep prefixes: the whole budget is used
        max_blocks_needed = None if self.config.cache.enable_prefix_caching else (
            sched_config.max_running * -(-self.max_model_len // block_size) * groups.num_groups)
        self.num_kv_blocks = num_kv_blocks_for(
            self.config.cache, runner.kv_bytes_per_block(), self.device, max_blocks_needed,
            block_scale=len(groups.layer_groups) // groups.group_size,
        )
        self._check_host_kv_memory(runner)
        tiers = self._build_kv_tiers(runner)
        if tiers is not None:  # an engine dropped without close() (an LLM let go) stops the tiers' I/O threads
            weakref.finalize(self, tiers.close)  # at once: the KV manager's cycles would hold them to a collection
        kv_manager = KVCacheManager(self.num_kv_blocks, block_size, self.config.cache.enable_prefix_caching, tiers,
                                    groups)
        self._fit_max_model_len(kv_manager, sched_config.max_num_batched_tokens)
        sched_config = dataclasses.replace(sched_config, max_model_len=self.max_model_len)
        host_copies = HostCopies(tiers.host_slab, tiers.publish_offloads) if tiers is not None else None
        runner.init_kv_cache(self.num_kv_blocks, self.max_model_len, host_copies, sched_config.max_running)
        speculative = self.config.speculative
        speculation = SpeculationPolicy(speculative) if speculative.enabled else None
        scheduler = Scheduler(sched_config, kv_manager, speculation, self.config.model.pooling_type)
        return EngineCore(runner, scheduler, kv_manager)

    def _fit_max_model_len(self, kv: KVCacheManager, max_chunk: int) -> None:
        """Lower ``max_model_len`` to the longest request the whole KV pool holds, saying so: else every request
        without max_tokens (which may grow to max_model_len: the OpenAI SDK's default) would be refused, on a server
        that started and said it was healthy. (vLLM refuses to start; SGLang caps requests likewise.)"""
        if kv.max_blocks_for(self.max_model_len, max_chunk) <= kv.num_blocks_total:
            return
        low, high = 0, self.max_model_len  # low fits (0 tokens need no block), high does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if kv.max_blocks_for(middle, max_chunk) <= kv.num_blocks_total else (low, middle)
        if low < 2:
            raise ValueError(f"the KV cache ({kv.num_blocks_total} blocks of {kv.block_size} tokens) holds no request "
                             "of a prompt and a token: raise --kv-cache-memory or --num-kv-blocks")
        logger.warning("the KV cache (%d blocks of %d tokens) holds requests of at most %d tokens: "
                       "max_model_len lowered from %d (raise --kv-cache-memory or --num-kv-blocks to keep it)",
                       kv.num_blocks_total, kv.block_size, low, self.max_model_len)
        self.max_model_len = low

    def _kv_groups(self, runner: ModelRunner) -> KVCacheGroups:
        """The model's KV cache groups (``kv/groups.py``): sliding-window layers apart, freeing the blocks their
        window has passed, unless a feature that keeps one block table per request is on; then the plain layout,
        said once in the log."""
        windows = runner.layer_windows()
        # a window as long as the context never frees a block: such a layer is laid out as a full one
        groups = KVCacheGroups.of_layers([None if w is not None and w >= self.max_model_len else w for w in windows])
        reason = self._why_one_block_table(groups)
        if not groups.frees_blocks or reason is None:
            return groups
        logger.info("sliding-window layers keep all their KV blocks (one block table for every layer): %s",
                    reason)
        return KVCacheGroups.single(len(windows))

    def _why_one_block_table(self, groups: KVCacheGroups) -> str | None:
        """The feature on that does not yet know these KV cache groups, if any."""
        config = self.config
        reasons = (
            (config.cache.enable_prefix_caching and not groups.keys_prefix_tree,
             "the prefix cache is on, and it needs the model's full-attention layers in one group to key its tree "
             "(--no-enable-prefix-caching frees them)"),
            # the draft's KV is indexed by the target's block ids: with groups it would follow group 0's table in a
            # store as many blocks long as the (layers / group_size times larger) pool, most of it never used, and
            # its own sliding layers would free nothing; a layout of its own is not built
            (config.speculative.method == "draft", "a draft model shares the block tables"),
        )
        return next((reason for on, reason in reasons if on), None)

    def _check_host_kv_memory(self, runner: ModelRunner) -> None:
        """ValueError where the KV cache held in host memory, the pool on CPU and the host tier together, is
        larger than the memory this process may take."""
        cache = self.config.cache
        pool = self.num_kv_blocks * runner.kv_bytes_per_block() if self.device.type == "cpu" else 0
        host_tier = (cache.kv_offload_memory if cache.kv_offload_memory is not None else
                     DEFAULT_STAGING_GIB if cache.offloads_kv else 0) * 2**30
        check_fits_host_memory(pool + host_tier, "--kv-cache-memory, --num-kv-blocks or --kv-offload-memory")

    def _build_kv_tiers(self, runner: ModelRunner) -> TieredStore | None:
        """The host and disk tiers under the device pool, if asked for. With a disk tier alone, a host slab of
        ``DEFAULT_STAGING_GIB`` stages its reads and writes."""
        cache = self.config.cache
        if not cache.offloads_kv:
            return None
        spec = runner.kv_cache_spec()
        block_format = BlockFormat(runner.model_identity(), spec.kv_dtype.layout, spec.block_size, spec.bytes_per_block,
                                   runner.kv_groups.layout)
        host_gib = cache.kv_offload_memory if cache.kv_offload_memory is not None else DEFAULT_STAGING_GIB
        return TieredStore(block_format, host_gib * 2**30, host_is_tier=cache.kv_offload_memory is not None,
                           disk_dir=cache.kv_offload_dir, disk_bytes=cache.disk_tier_bytes,
                           pin_memory=self.device.type == "cuda")

    def observe_steps(self, observer: Callable[[SchedulerOutput], None] | None) -> None:
        """Have ``observer`` called with each step as its tokens come back, before the engine takes them (the
        bench's ``StepTrace``); None stops it."""
        self.core.step_observer = observer

    def flush_kv_offload(self, timeout: float | None = None) -> None:
        """Hand every computed block still due to the tiers over, and wait up to ``timeout`` seconds for the
        disk tier's writes (a restart then finds them all)."""
        store = self.core.kv_manager.store
        if store is not None:
            self.core.offload_pending()
            store.flush(timeout)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Empty the prefix cache (vLLM's): every cached block no request holds is let go of, at once. True where
        the cache is then empty; False, logging why, where running requests still hold cached blocks: those stay
        cached (their outputs are untouched) and become evictable as they finish, so a caller that needs the cache
        empty calls again once they have (vLLM resets nothing in that case). ``reset_connector`` (vLLM's name for
        its external KV cache) empties the KV tiers too: the host tier and this server's disk-tier files, but
        blocks pinned for a load or a write under way (``TieredStore.clear``); else the tiers are left as they
        are. ``reset_running_requests`` (vLLM's: preempt them to free their blocks) is refused."""
        if reset_running_requests:
            raise InvalidParameter("reset_running_requests", "reset_running_requests=True is not supported: the "
                                   "blocks running requests hold are kept; reset again once they finish, or abort "
                                   "them first")
        kv = self.core.kv_manager
        num_dropped = kv.reset_prefix_cache()
        tiers = f", and {kv.clear_tiers()} blocks of the KV tiers" if reset_connector and kv.store else ""
        if kv.num_cached_blocks:
            logger.warning("prefix cache reset in part: %d cached blocks dropped%s; %d stay cached, held by the %d "
                           "running requests (reset again once they finish)", num_dropped, tiers,
                           kv.num_cached_blocks, self.core.scheduler.num_running)
            return False
        logger.info("prefix cache reset: %d cached blocks dropped%s", num_dropped, tiers)
        return True

    def start_profile(self, trace_dir: str) -> None:
        """Record ``torch.profiler`` traces of the steps from now on, into ``trace_dir`` (vLLM's; ``StepProfiler``);
        call it on the thread that steps the engine. RuntimeError if a profile is recording already."""
        self.profiler.start(trace_dir)

    def stop_profile(self) -> str:
        """Stop recording and write the trace (one a start / stop pair); returns its path. RuntimeError naming
        ``start_profile`` where no profile is recording."""
        return self.profiler.stop()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (level 1: its blocks, the prefix cache, the paged tensors' memory) or the weights
        too (level 2), as vLLM's sleep mode does; requests are refused (``EngineAsleep``) until ``wake_up``. Only
        between requests (ValueError where any is unfinished) and where ``check_sleep`` finds nothing against it."""
        released = self.check_sleep(level)
        if self.core.scheduler.requests or self.output_processor.request_ids():
            raise ValueError("sleep mode starts between requests: some are unfinished (abort them, or let them end)")
        while self.has_unfinished_requests():  # finished requests' state in the runner: an empty step drops it
            self.step()
        self.reset_prefix_cache()  # no request holds a block: the cache empties
        self.core.kv_manager.drop_planned_offloads()  # they would copy blocks whose memory goes now
        runner = self.core.runner
        runner.release_kv_cache()
        if WEIGHTS in released:
            runner.release_weights()
        self.asleep = released
        logger.info("sleep mode: the %s released", " and the ".join(sorted(released)))

    def check_sleep(self, level: int) -> frozenset[str]:
        """What ``sleep(level)`` would release, the requests aside; ``InvalidParameter`` for a level but 1 and 2,
        ValueError where the engine is asleep already, runs tensor parallelism or a draft model (sleep mode is not
        built for them), or serves LoRA adapters at level 2 (they would leave with the weights)."""
        released = released_by(level)
        if self.asleep:
            raise ValueError(f"the engine is asleep already (its {' and '.join(sorted(self.asleep))} released): "
                             "wake it up first")
        if self.config.parallel.tensor_parallel_size > 1 or self.config.speculative.method == "draft":
            raise ValueError("sleep mode is not built for tensor parallelism nor a draft model")
        if WEIGHTS in released and self.lora_adapters.served:
            raise ValueError("sleep level 2 drops the weights with the LoRA adapters installed on them: remove the "
                             "adapters first, or sleep at level 1")
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``sleep`` released and ``tags`` name ("weights", "kv_cache"; None: all), vLLM's; the
        weights are read again from the checkpoint. A part not asleep is left as it is; the KV cache wakes with or
        after the weights (its step graphs are of the model), else ``InvalidParameter`` naming ``tags``."""
        woken = woken_by(tags) & self.asleep
        if KV_CACHE in woken and WEIGHTS in self.asleep - woken:
            raise InvalidParameter("tags", "the KV cache wakes with or after the weights: wake the weights first")
        runner = self.core.runner
        if WEIGHTS in woken:
            runner.reload_weights(load_checkpoint(self.location, self.dtype, self.config.model.load_format))
        if KV_CACHE in woken:
            runner.restore_kv_cache()
        self.asleep -= woken
        if woken:
            logger.info("sleep mode: the %s back%s", " and the ".join(sorted(woken)),
                        "" if not self.asleep else f"; the {' and '.join(sorted(self.asleep))} still released")

    def warm_up(self) -> None:
        """Run one request of one token through a prefill and a decode step (a pooling engine's: a prefill),
        leaving the pool empty (and no block cached at a block size over 2): what a first step does once (a step
        graph recorded, kernels loaded, torch's lazy imports) is done before a server says it is ready, not on its
        first clients' time nor while a burst of them holds every file descriptor (a step that cannot open a module
        fails the engine)."""
        max_tokens = min(2, self.max_model_len - 1)  # a context of 2 (the shortest) takes one after the prompt's
        params: SamplingParams | PoolingParams = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True)
        if "generate" not in self.supported_tasks:  # --runner pooling: a prefill is all its requests run
            params = PoolingParams()
        self.add_request(WARM_UP_REQUEST_ID, {"prompt_token_ids": [0]}, params)
        while self.has_unfinished_requests():
            self.step(final_only=True)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What requests this engine serves (vLLM's ``get_supported_tasks``): "generate", "embed", "token_embed"
        (``--runner``)."""
        return self.config.model.supported_tasks

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue one request, a generation or (``PoolingParams``) a pooling one; raises ValueError
        (naming the problem) and queues nothing if bad. ``priority``: under the priority scheduling policy, the
        lower the sooner (vLLM's); 0 under the others. ``lora_request``: the LoRA adapter it runs with (None: the
        base model)."""
        self.add_processed(request_id, self.process(prompt, params), priority, lora_request)

    def process(self, prompt: PromptInput, params: SamplingParams | PoolingParams) -> ProcessedPrompt:
        """``prompt`` tokenized and checked for ``params`` (``InputProcessor``), nothing queued; ValueError naming
        what is wrong. Reads only the tokenizer and the model's limits: a server runs it on a thread of its own."""
        if isinstance(params, PoolingParams):
            return self.input_processor.process_pooling(prompt, params, self.config.model.pooling_normalize)
        return self.input_processor.process(prompt, params)

    def add_processed(self, request_id: str, processed: ProcessedPrompt, priority: int = 0,
                      lora_request: LoRARequest | None = None) -> None:
        """Queue one request whose prompt ``input_processor.process`` has tokenized and checked (which reads only
        the tokenizer and the model's limits, so a server runs it beside the steps, on a thread of its own). An
        adapter named for the first time is read and installed here, on the thread that steps the engine."""
        if self.asleep:
            raise EngineAsleep(self.asleep)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidParameter("priority", f"priority must be an integer, got {priority!r}")
        task = "generate" if processed.pooling is None else processed.pooling.task
        if task not in self.supported_tasks:
            raise UnsupportedTask(task, self.config.model.runner)
        adapter = self.lora_adapters.resolve(lora_request)
        request = Request(request_id, processed.prompt_token_ids, processed.params, self.eos_token_ids,
                          grammar=processed.grammar, cache_salt=processed.cache_salt, priority=priority,
                          lora_id=0 if adapter is None else adapter.request.lora_int_id,
                          lora_digest=None if adapter is None else adapter.digest, pooling_params=processed.pooling)
        # the frontend first: it still tracks an n > 1 request whose first sample the scheduler has finished
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, processed.params,
                                          self.eos_token_ids, pooling=processed.pooling is not None)
        try:
            self.core.add_request(request)
        except BaseException:
            self.output_processor.abort(request_id)
            raise

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput | PoolingRequestOutput]:
        """Stop requests now and free their KV blocks; returns their final outputs (finish reason abort)."""
        request_ids = list(request_ids)
        sample_ids = self._all_sample_ids(request_ids)
        scheduled = {rid: self._first_scheduled_time(rid) for rid in request_ids}  # before the scheduler forgets
        self.core.finish_requests(sample_ids, FinishReason.ABORT)
        if self._held:  # outputs of a step already run, not yet processed: they would land on a reused id
            aborted = set(sample_ids)
            self._held = [output for output in self._held if output.request_id not in aborted]
        self.lora_adapters.drop_retired()
        return [out for rid in request_ids if (out := self.output_processor.abort(rid, scheduled[rid])) is not None]

    def remove_lora(self, lora_int_id: int) -> int:
        """Stop serving LoRA adapter ``lora_int_id`` (vLLM's): a request naming it from now on is refused; those
        running or waiting with it finish with it (how many is returned), then its weights leave the model.
        ``InvalidParameter`` where no adapter of that id is served."""
        return self.lora_adapters.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the LoRA adapters served (vLLM's)."""
        return {lora_request.lora_int_id for lora_request in self.lora_adapters.served}

    def step(self, final_only: bool = False) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one engine step and return the outputs of the requests that moved (``final_only``: of those that
        finished).

        With ``overlap_outputs`` (CUDA) the outputs returned are the previous step's: they are detokenized
        and checked for stop strings while the device runs this step, whose outputs wait for the next call::

            host:    | schedule N, launch N | process N-1's outputs | wait for N, update |
            device:                         |<------------- step N -------------->|

        A request a stop string ends then runs one step more, whose token is dropped. With
        ``overlap_scheduling`` too, while step N runs the next one is scheduled and queued behind it
        (``EngineCore.launch_continuation``; where it can be, else it is scheduled after N's update, as
        above), so the device goes from step to step without waiting for the host::

            host:    | schedule N+1, launch N+1 | process N-1's outputs | wait for N, update | (next call)
            device:  |<------------ step N ------------>|<------------ step N+1 ------------>|

        A request then runs up to two steps past a stop string or EOS, and their tokens are dropped.

        A step that raises fails every request: the steps not back yet are abandoned (``EngineCore.abandon_steps``:
        nothing they planned is kept), every request is aborted, and the exception goes to the caller. The engine
        is then as it was before those requests came, and takes new ones; but under tensor parallelism the
        workers stop at a failed step (``WorkerGroup.stepping``), and every later step raises."""
        try:
            with self.profiler.step_range():
                return self._step(final_only)
        except BaseException:
            self._next, self._held = None, []
            self.core.abandon_steps()
            self.abort_request(self.output_processor.request_ids())
            raise

    def _step(self, final_only: bool) -> list[RequestOutput | PoolingRequestOutput]:
        if not self.overlap_outputs:
            processed = self.output_processor.process(self.core.step(), final_only)
        else:
            pending = self._next or self.core.launch_step()
            self._next = self.core.launch_continuation(pending) if self.overlap_scheduling else None
            held, self._held = self._held, []
            processed = self.output_processor.process(held, final_only)
            self._held = self.core.finish_step(pending)  # stopped requests finish after the step they ran in
        if processed.stopped_request_ids:
            self.core.finish_requests(processed.stopped_request_ids, FinishReason.STOP)
        self.lora_adapters.drop_retired()
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self._held) or self._next is not None

    def _all_sample_ids(self, request_ids: list[str]) -> list[str]:
        return [sid for rid in request_ids for sid in self.output_processor.sample_request_ids(rid)]

    def _first_scheduled_time(self, request_id: str) -> float | None:
        """When the scheduler first took the request (its earliest sample), None if it never did: what the output
        processor learns only with a token, so a request aborted during its prefill would not carry it."""
        requests = self.core.scheduler.requests
        times = [request.first_scheduled_time for sid in self.output_processor.sample_request_ids(request_id)
                 if (request := requests.get(sid)) is not None and request.first_scheduled_time is not None]
        return min(times, default=None)

    def stats(self) -> dict[str, Any]:
        kv = self.core.kv_manager
        num_free = kv.num_free_blocks()
        return {
            "block_size": kv.block_size,
            "num_blocks_total": kv.num_blocks_total,
            "num_blocks_used": kv.num_blocks_total - num_free,
            "num_blocks_free": num_free,
            "kv_cache_groups": kv.groups.num_groups,
            "kv_blocks_windowed": kv.num_windowed_blocks,  # held by sliding-window groups, bounded by their windows
            "kv_blocks_full": kv.num_blocks_total - num_free - kv.num_windowed_blocks,
            "weights_format": self.core.runner.weights_format(),
            "activations_format": self.core.runner.activations_format,
            "weights_bytes": self.core.runner.weight_bytes,
            "kv_cache_dtype": self.core.runner.kv_cache_spec().kv_dtype.name,
            "kv_cache_bytes": self.core.runner.kv_cache_bytes,
            "peak_num_blocks_used": self.core.peak.num_blocks_used,
            "kv_waste_at_peak": self.core.peak.waste,
            "num_running": self.core.scheduler.num_running,
            "num_waiting": self.core.scheduler.num_waiting,
            "num_steps_scheduled_ahead": self.core.scheduler.num_continued_steps,
            # run through the model since start: prompt tokens not found in the prefix cache, generated ones,
            # speculative drafts, and those recomputed after a preemption
            "num_tokens_computed": self.core.scheduler.num_tokens_computed,
            "num_graph_replays": self.core.runner.num_graph_replays,  # steps run through a CUDA or CPU step graph
            **self.core.scheduler.preemption_stats(),
            **self.core.scheduler.prefix_cache_stats(),
            **(store.stats() if (store := self.core.kv_manager.store) else {}),
            **(copies.stats() if (copies := self.core.runner.host_copies) else {}),
            **self._structured_output_stats(),
            **(speculation.stats() if (speculation := self.core.scheduler.speculation) else {}),
            **(self._lora_stats() if self.config.lora.enable_lora else {}),
        }

    def _lora_stats(self) -> dict[str, Any]:
        """The names of the LoRA adapters that running and waiting requests run with, comma-separated in name order
        (vLLM's ``lora_requests_info`` labels), and ``max_loras``."""
        running, waiting = self.core.scheduler.adapters_in_use()
        return {"running_lora_adapters": ",".join(sorted(map(self.lora_adapters.name_of, running))),
                "waiting_lora_adapters": ",".join(sorted(map(self.lora_adapters.name_of, waiting))),
                "max_loras": self.config.lora.max_loras}

    def _structured_output_stats(self) -> dict[str, Any]:
        grammar = self.core.runner.grammar
        if grammar is None:
            return {}
        masks = grammar.stats
        return {"grammar_mask_steps": masks.steps, "grammar_mask_rows": masks.rows,
                "grammar_mask_fill_seconds": masks.fill_seconds, "grammar_mask_wait_seconds": masks.wait_seconds}
