"""ModelRunner: applies one SchedulerOutput (a diff of its persistent batch) on the device and returns only
token ids (and logprobs)."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
from typing import Callable

import torch

from kvserve.attention.backend import AttentionBackend, AttentionInputs, AttentionMetadata, build_step_metadata
from kvserve.attention.selector import select_backend
from kvserve.config import ModelConfig
from kvserve.kv.groups import KVCacheGroups
from kvserve.kv.quant import kv_cache_dtype
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from kvserve.model.base import CausalLM
from kvserve.model.deferred_layout import DeferredLayouts
from kvserve.model.identity import model_identity
from kvserve.model.layers.fused_ops import UsesFusedOps
from kvserve.model.layers.ggml_qdot import QDotGemm
from kvserve.model.layers.lora import Projections, install_adapter, remove_adapter
from kvserve.model.lora_adapter import LoRAAdapter
from kvserve.model.loader import Checkpoint
from kvserve.model.registry import load_model
from kvserve.outputs import TokenLogprobs
from kvserve.sample.grammar import GrammarProcessor, StructuredOutputCompiler
from kvserve.sample.logits_processors import default_processors
from kvserve.sample.metadata import SamplingBatch
from kvserve.sample.sampler import Sampler
from kvserve.sched.output import KVTransferPlan, ModelOutput, SchedulerOutput
from kvserve.worker.pooler import Pooler
from kvserve.worker.draft_model import DraftModel
from kvserve.worker.cpu_graph import CpuStepGraphs
from kvserve.worker.heap import keep_large_blocks
from kvserve.worker.step_graphs import StepGraphs, captures_cuda_graphs, step_graphs_for
from kvserve.worker.input_batch import InFlightTokens, InputBatch, PersistentBatch
from kvserve.worker.kv_transfers import HostCopies
from kvserve.worker.peers import StepPeers

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DeferredDraw:
    """A continued step's hidden states, whose draw waits for the tokens of the step before it; ``tokens``
    reads the draw back once it is launched (``ModelRunner.draw_deferred``)."""

    batch: InputBatch
    hidden: torch.Tensor
    tokens: Callable[[], ModelOutput] | None = None


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """How a runner holds its model and KV cache: one object, so that rank 0 and every tensor-parallel worker
    (``WorkerSpec`` carries it) build theirs alike."""

    block_size: int
    seed: int = 0
    weights: str = "dense"  # as ``model.weight_format.weight_format`` decided
    kv_cache_dtype: str = "auto"
    quantize_activations: bool = False
    enforce_eager: bool = False
    cpu_offload_bytes: int = 0
    dense_layouts_in_background: bool = False
    attention_backend: str | None = None  # forced (config.ATTENTION_BACKENDS); None: the device's best
    logprobs_mode: str = ModelConfig.logprobs_mode  # what logprob entries hold (config.LOGPROBS_MODES)
    pooling_type: str = ModelConfig.pooling_type  # how pooling requests' "embed" pools (config.POOLING_TYPES)


class ModelRunner:
    """Owns the model weights, the paged KV tensors, the persistent batch, the attention backend, the sampler
    state and, with draft speculation, the draft model (which fills the step's draft slots before the forward).

    Under tensor parallelism (``peers.tp.size`` > 1) every rank runs one, over its part of the weights and of the
    KV heads, and ``peers`` links them (``worker/parallel.py``): rank 0's sends each step to the workers before
    running it, samples, and sends the tokens; a worker's runs the same steps, joins the model's collectives,
    and appends the tokens it receives. CPU step graphs are off (they do not record collectives). Draft
    speculation is refused under tensor parallelism (``EngineConfig``): its drafts are filled after the step is
    sent."""

    def __init__(
        self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, options: RunnerOptions, *,
        structured: StructuredOutputCompiler | None = None, draft: DraftModel | None = None,
        peers: StepPeers | None = None,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.options = options
        self.block_size = options.block_size
        self.kv_cache_dtype = kv_cache_dtype(options.kv_cache_dtype, dtype)
        self.backend: AttentionBackend = select_backend(device, dtype, options.attention_backend,
                                                        kv_dtype=self.kv_cache_dtype)
        self.weights = options.weights
        self.peers = peers or StepPeers()
        self.tp = self.peers.tp
        self.model = self._load_model(checkpoint)
        self._weights_format = self._find_weights_format()
        self.activations_format = self._find_activations_format()
        self.weight_bytes = self.model.weight_bytes()  # this rank's; the draft model's are not counted
        if device.type == "cpu":  # after the load, whose buffers the kept heap would hold on to
            keep_large_blocks()  # a large batch's logits and the sampler's temporaries are not mapped anew a step
        self.layouts = DeferredLayouts.start(self.model)  # None unless some are left for after start-up
        self.grammar = GrammarProcessor(structured) if structured is not None else None
        self.sampler = Sampler(options.seed, default_processors(self.grammar), options.logprobs_mode)
        self.pooler = Pooler(options.pooling_type)
        self.kv: KVCacheStorage | None = None
        self.host_copies: HostCopies | None = None  # with KV tiers: copies to and from their host slab
        self.batch: PersistentBatch | None = None
        self.kv_groups = KVCacheGroups.single(self.model.num_layers)
        self._group_windows = [self.model.sliding_windows()]
        self.enforce_eager = options.enforce_eager
        self.graphs: StepGraphs | None = None
        self._in_flight: InFlightTokens | None = None  # the last launched step's tokens until it is finished
        self._deferred: DeferredDraw | None = None  # a continued step's draw, until the step before is read back
        self.draft = draft
        self._lora_projections: Projections | None = None  # the model's, once an adapter is installed
        self._kv_spec: KVCacheSpec | None = None  # kv_cache_spec's, kept: the model may be released (sleep mode)
        self._num_blocks, self._max_blocks, self._max_running = 0, 0, 0  # init_kv_cache's, to allocate it again
        self._num_replays_released = 0  # steps replayed by step graphs since released (sleep mode)

    def _load_model(self, checkpoint: Checkpoint) -> CausalLM:
        options = self.options
        return load_model(checkpoint, self.backend, self.dtype, self.device, options.weights,
                          options.quantize_activations, self.tp, options.cpu_offload_bytes,
                          defer_dense=options.dense_layouts_in_background)

    @property
    def num_graph_replays(self) -> int:
        """Steps that ran through a step graph (the rest ran eagerly)."""
        return self._num_replays_released + (self.graphs.num_replays if self.graphs is not None else 0)

    def weights_format(self) -> str:
        """How the linear layers hold their weights: the dtype, the GGUF block types kept (e.g. "gguf Q4_1,
        Q8_0", from the layers themselves), or the weight-only scheme they were quantized to at load; " (mapped)"
        where they are the checkpoint file's mapped pages (``load_format="mmap"``)."""
        return self._weights_format

    def _find_weights_format(self) -> str:
        # a walk over every module: done once, as stats() (which reports it) runs at every server step
        kept = sorted({part.qtype.name for layer in self.model.modules()
                       for part in getattr(layer, "ggml_parts", None) or ()})
        if self.weights in ("int8", "int4"):
            return f"{self.weights} weight-only"
        if self.weights == "fp8":
            return "fp8 e4m3 (weights per channel, activations per token)"
        if not kept:
            dense = str(self.dtype).removeprefix("torch.")
            return f"{dense} (mapped)" if self.weights == "dense-mmap" else dense
        return f"gguf {', '.join(kept)}" + (" (mapped)" if self.weights == "gguf-mmap" else "")

    def _find_activations_format(self) -> str:
        """What the linear layers multiply: the activations' dtype, or int8 codes of them where the int8 kernel
        serves (``quantize_activations``)."""
        dtype = str(self.dtype).removeprefix("torch.")
        if any(isinstance(getattr(getattr(layer, "method", None), "gemm", None), QDotGemm)
               for layer in self.model.modules()):
            return f"int8 into the linear layers ({dtype} elsewhere)"
        return dtype

    def layer_windows(self) -> list[int | None]:
        return self.model.layer_windows()

    def add_lora(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Install ``adapter`` on the model's layers under ``adapter_id`` (``NewRequestData.lora_id``), rank 0's
        then the workers' (each its part); ``LoRAAdapterError`` where it does not fit the model, nothing installed."""
        if self._lora_projections is None:
            self._lora_projections = self.model.lora_projections()
        install_adapter(self._lora_projections, adapter_id, adapter, self.dtype, self.device)
        self._forget_adapter_graphs(adapter_id)
        self.peers.add_lora(adapter_id, adapter)

    def remove_lora(self, adapter_id: int) -> None:
        if self._lora_projections is not None:
            remove_adapter(self._lora_projections, adapter_id)
        self._forget_adapter_graphs(adapter_id)
        self.peers.remove_lora(adapter_id)

    def _forget_adapter_graphs(self, adapter_id: int) -> None:
        """CPU step graphs recorded with the adapter replay its old weights: dropped (CUDA graphs hold none)."""
        if isinstance(self.graphs, CpuStepGraphs):
            self.graphs.forget_adapter(adapter_id)

    def lora_bytes(self, adapter_id: int) -> int:
        """The bytes adapter ``adapter_id``'s weights take on the model's layers (0 where it is not installed)."""
        if self._lora_projections is None:
            return 0
        layers = {layer for layer, _ in self._lora_projections.values()}  # a packed layer serves several names
        return sum(tensor.nbytes for layer in layers for tensor in layer.lora.get(adapter_id, ()))

    def use_kv_groups(self, groups: KVCacheGroups) -> None:
        """Lay the KV cache out in these groups (``kv/groups.py``; one group, the plain layout, until called):
        before ``kv_bytes_per_block`` sizes the pool and ``init_kv_cache`` allocates it."""
        if len(groups.layer_groups) != self.model.num_layers:
            raise ValueError(f"KV cache groups for {len(groups.layer_groups)} layers, the model has {self.model.num_layers}")
        windows = self.layer_windows()
        self.kv_groups = groups
        self._kv_spec = None
        self._group_windows = [{windows[layer] for layer in groups.layers_of(g)} for g in range(groups.num_groups)]

    def kv_cache_spec(self) -> KVCacheSpec:
        if self._kv_spec is None:
            spec = self.model.kv_cache_spec(self.block_size, self.dtype, self.kv_cache_dtype)
            if self.kv_groups.num_groups > 1:
                spec = dataclasses.replace(spec, layer_tensors=self.kv_groups.layer_tensors)
            self._kv_spec = spec
        return self._kv_spec

    def kv_bytes_per_block(self) -> int:
        """Bytes one block id holds: the target's KV, and the draft model's (the same block ids index both)."""
        draft = self.draft.kv_cache_spec().bytes_per_block if self.draft is not None else 0
        return self.kv_cache_spec().bytes_per_block + draft

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the paged KV tensors allocated: the target's and the draft model's."""
        kv = [self.kv, self.draft.kv if self.draft is not None else None]
        return sum(storage.nbytes for storage in kv if storage is not None)

    def model_identity(self) -> str:
        """A fingerprint of the loaded weights, the model's configuration and what shapes their KV (device, dtypes,
        weight format, attention backend, fused ops: the C kernels' rounding is not their twin's): KV tiers on disk
        use blocks written under the same fingerprint only."""
        fused = next((type(m.ops).__name__ for m in self.model.modules() if isinstance(m, UsesFusedOps)), "none")
        extra = "|".join((type(self.model).__name__, self.device.type, str(self.dtype), self.weights_format(),
                          type(self.backend).__name__, fused))
        return model_identity(itertools.chain(self.model.named_parameters(), self.model.named_buffers()), extra,
                              self.model.config.to_dict())

    def init_kv_cache(self, num_blocks: int, max_model_len: int, host_copies: HostCopies | None = None,
                      max_running: int = 0) -> None:
        """Allocate the paged KV tensors and the persistent batch (block tables sized for ``max_model_len``);
        ``host_copies`` copies the steps' transfers into and out of the KV tiers' host rows. Rank
        0's has the workers allocate theirs. On CUDA, decode steps of up to ``max_running`` sequences are
        captured as CUDA graphs (0: none)."""
        self.peers.init_kv_cache(num_blocks, max_model_len, self.kv_groups)
        if self.tp.size > 1:
            max_running = 0  # no graphs under tensor parallelism (below)
        if self.device.type == "cuda" and self.model.weight_streamer is not None and not self.enforce_eager:
            logger.info("--cpu-offload-gb: decode steps run eagerly (streamed weights are not captured in CUDA graphs)")
        self._num_blocks, self._max_blocks = num_blocks, -(-max_model_len // self.block_size)
        self._max_running = max_running
        self.batch = PersistentBatch(self._max_blocks, self.block_size, self.device,
                                     num_groups=self.kv_groups.num_groups)
        self.host_copies = host_copies
        self._allocate_kv_cache()
        if self.tp.size > 1 and self.tp.rank == 0 and not self.enforce_eager:
            logger.info("tensor parallel: every step runs eagerly (CPU step graphs do not record collectives)")

    def _allocate_kv_cache(self) -> None:
        """The paged KV tensors (and the draft model's), and the step graphs over them (none under tensor
        parallelism), as ``init_kv_cache`` sized them."""
        cuda_graphs = captures_cuda_graphs(self.model, self.backend, self.device, self.enforce_eager,
                                           self._max_running)
        self.kv = KVCacheStorage(self.kv_cache_spec(), self._num_blocks, self.device, scratch_block=cuda_graphs)
        if self.draft is not None:
            self.draft.init_kv_cache(self._num_blocks, self._max_blocks)
        self.graphs = None
        if self.tp.size == 1:
            self.graphs = step_graphs_for(self.model, self.backend, self.kv, self.device, self._max_blocks,
                                          self.enforce_eager, self._group_windows, self.kv_groups.layer_groups,
                                          self._max_running)

    def release_kv_cache(self) -> None:
        """Sleep mode: free the paged KV tensors and the step graphs over them (the batch must hold no request);
        ``restore_kv_cache`` allocates them again, their content lost."""
        if self.graphs is not None:
            self._num_replays_released += self.graphs.num_replays
        self.graphs, self.kv = None, None
        _return_freed_memory(self.device)

    def restore_kv_cache(self) -> None:
        self._allocate_kv_cache()

    def release_weights(self) -> None:
        """Sleep mode (level 2): drop the model's weights (after ``release_kv_cache``; the LoRA adapters installed
        with them); ``reload_weights`` builds the model again from its checkpoint."""
        if self.layouts is not None:
            self.layouts.stop()
            self.layouts = None
        self.model, self._lora_projections, self.weight_bytes = None, None, 0
        _return_freed_memory(self.device)

    def reload_weights(self, checkpoint: Checkpoint) -> None:
        self.model = self._load_model(checkpoint)
        self.weight_bytes = self.model.weight_bytes()
        self.layouts = DeferredLayouts.start(self.model)

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelOutput:
        """Apply the step's diff to the persistent batch, run the model, sample. Returns token ids only."""
        assert self.kv is not None and self.batch is not None, "init_kv_cache() must run before execute()"
        with self.peers.stepping():
            return self._launch(sched_out)()

    @torch.inference_mode()
    def launch(self, sched_out: SchedulerOutput) -> Callable[[], ModelOutput]:
        """``execute`` in two halves: this one queues the step's work on the device; the call it returns waits
        for the sampled tokens (the step's one sync) and records them. Call that before the next launch. On
        CUDA the host is free between the two; on CPU the work is done by the time this returns. Without
        tensor parallelism only (its ranks step together inside one ``stepping``)."""
        assert self.kv is not None and self.batch is not None, "init_kv_cache() must run before launch()"
        if self.tp.size > 1:
            raise RuntimeError("launch() runs without tensor parallelism; use execute()")
        return torch.inference_mode()(self._launch(sched_out))

    def _launch(self, sched_out: SchedulerOutput) -> Callable[[], ModelOutput]:
        self.peers.broadcast_step(sched_out)
        self.batch.update(sched_out)
        samples = self.peers.is_driver
        if samples:
            self._update_sampler(sched_out)
        if self.draft is not None:
            self.draft.drop(sched_out.finished_request_ids | sched_out.preempted_request_ids)
        self.pooler.drop(sched_out.finished_request_ids)
        self.apply_kv_transfers(sched_out.kv_transfers)
        if sched_out.is_empty:
            return lambda: ModelOutput(sampled_token_ids={})
        if self.draft is not None:  # before the sampler's prepare: the grammar masks walk the drafts
            sched_out = self.draft.fill(sched_out, self.batch)
        batch = self.batch.prepare(sched_out, self._in_flight)
        if samples and self._in_flight is not None and not all(map(self.sampler.is_history_free, batch.sampling.rows)):
            # a continued step with a row whose draw reads the token still in flight (a grammar's matcher): the
            # model runs now, the draw once that token is read back (``draw_deferred``)
            deferred = self._deferred = DeferredDraw(batch, self._forward(batch))
            return functools.partial(self._finish, sched_out, batch, deferred.hidden,
                                     functools.partial(self._deferred_tokens, deferred))
        if samples:
            self.sampler.prepare(batch.sampling)  # grammar masks start now, on a worker thread
        hidden = self._forward(batch)
        return functools.partial(self._finish, sched_out, batch, hidden, self._sample(batch, hidden))

    def can_continue(self, sched_out: SchedulerOutput) -> bool:
        """Whether the step after ``sched_out`` (the last one launched) may be launched before its tokens are
        read back (``EngineCore.launch_continuation``), as far as the runner goes: one rank, no draft model, its
        tokens still on the device, and no prompt logprobs to read back (that read would wait for the next step
        too). A row whose draw reads its tokens (``Sampler.is_history_free``: a grammar) has its draw deferred.
        Which rows continue is the scheduler's (``Scheduler.schedule_continuation``)."""
        if self.tp.size > 1 or self.draft is not None or self._in_flight is None or self.batch is None:
            return False
        return not any(r.prompt_logprobs for r in sched_out.requests)

    def draw_deferred(self) -> None:
        """Launch the draw of a continued step whose rows read their history (``_launch``), once the step before
        it is finished: its tokens are then in every row's outputs and in the grammars' matchers, so each row
        draws as it would have after a plain update (the grammar's mask filled now, its position counting no
        token in flight). On a GPU the model's forward for the step ran meanwhile. No-op if none waits."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._draw(deferred)

    def abandon_steps(self) -> None:
        """The steps launched and not finished are abandoned (one raised: ``EngineCore.abandon_steps``): no token of
        theirs is in flight for a next step to read, and no draw of theirs waits."""
        self._in_flight, self._deferred = None, None

    def _deferred_tokens(self, deferred: DeferredDraw) -> ModelOutput:
        if self._deferred is deferred:  # not drawn after the step before finished: now, before reading back
            self._deferred = None
            self._draw(deferred)
        assert deferred.tokens is not None
        return deferred.tokens()

    @torch.inference_mode()
    def _draw(self, deferred: DeferredDraw) -> None:
        assert self.batch is not None
        batch = deferred.batch
        rows = [self.batch.sampling_row(request_id) for request_id in batch.sample_request_ids]
        batch = dataclasses.replace(batch, sampling=SamplingBatch.of_requests(rows, batch.draft_token_ids))
        self.sampler.prepare(batch.sampling)
        deferred.tokens = self._sample(batch, deferred.hidden)

    def _finish(self, sched_out: SchedulerOutput, batch: InputBatch, hidden: torch.Tensor,
                sampled: Callable[[], ModelOutput]) -> ModelOutput:
        output = sampled()
        self.batch.append_sampled(output.sampled_token_ids)
        if self.draft is not None:
            self.draft.record(sched_out, output.sampled_token_ids)
        for request_id, draft in zip(batch.sample_request_ids, batch.draft_token_ids):
            if draft:
                self.batch.drop_rejected_blocks(request_id)
        output.prompt_logprobs.update(self._prompt_logprobs(batch, hidden))
        if batch.pooling and self.peers.is_driver:
            output.pooled.update(self.pooler.pool(batch.pooling, hidden))
        return output

    def _update_sampler(self, sched_out: SchedulerOutput) -> None:
        self.sampler.drop(sched_out.finished_request_ids)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, the dense layouts still under way and the grammar masks'
        thread."""
        if self.layouts is not None:
            self.layouts.stop()
        if self.grammar is not None:
            self.grammar.close()
        self.peers.close()

    def _forward(self, batch: InputBatch) -> torch.Tensor:
        """The model's hidden states for the step: replayed from a step graph (CPU or CUDA) where one serves it (on
        CPU a step with LoRA adapters too, from a graph of its set of adapters)."""
        if self.layouts is not None and self.layouts.done:
            self._layouts_landed()
        graphs = self.graphs
        if graphs is not None and (hidden := graphs.forward(batch.input_ids, batch.positions, batch.attn,
                                                            batch.lora)) is not None:
            return hidden
        return self.model(batch.input_ids, batch.positions, self.step_metadata(batch.attn), self.kv, batch.lora)

    def _layouts_landed(self) -> None:
        """The deferred dense layouts are done: graphs recorded before them replay the blocks' kernels, so
        they are recorded again; the weights' bytes now count the copies."""
        self.layouts = None
        if isinstance(self.graphs, CpuStepGraphs):  # the layouts are a CPU layout's
            self.graphs.clear()
        self.weight_bytes = self.model.weight_bytes()

    def step_metadata(self, attn: AttentionInputs) -> AttentionMetadata:
        """The backend's metadata of a step, one per KV cache group where there are several."""
        return build_step_metadata(self.backend, attn, self._group_windows, self.kv_groups.layer_groups)

    def apply_kv_transfers(self, plan: KVTransferPlan) -> None:
        """Apply a step's block moves in the plan's order (``KVTransferPlan``): offloads (they save blocks this
        step may overwrite), fork copies, swap-outs, then tier loads and swap-ins."""
        assert self.kv is not None
        host = self.host_copies
        assert host is not None or not (plan.offloads or plan.loads or plan.swap_outs or plan.swap_ins), \
            "a tier transfer but no KV tiers"
        if plan.offloads:
            host.offload(self.kv, plan.offloads)
        self.kv.copy_blocks(plan.copies)
        if self.draft is not None:
            self.draft.copy_blocks(plan.copies)
        if plan.swap_outs:
            host.swap_out(self.kv, plan.swap_outs)
        if plan.loads:
            host.load(self.kv, plan.loads)
        if plan.swap_ins:
            host.swap_in(self.kv, plan.swap_ins)

    def _sample(self, batch: InputBatch, hidden: torch.Tensor) -> Callable[[], ModelOutput]:
        """Queue the sampling; the call returned gives the tokens each sampling request appends: one, or a
        speculating request's accepted drafts + 1."""
        if not batch.sample_request_ids:
            return lambda: ModelOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # under TP every rank joins the head
        if not self.peers.is_driver:
            return lambda: ModelOutput(self.peers.share_sampled(None))
        sampled = self.sampler.launch(logits, batch.sampling)
        in_flight = None
        if not any(batch.draft_token_ids):  # a row per request: a next step may read its token on the device
            in_flight = InFlightTokens({rid: i for i, rid in enumerate(batch.sample_request_ids)}, sampled.token_ids)
        self._in_flight = in_flight

        def tokens() -> ModelOutput:
            result = sampled()  # the token ids' host copy is the step's one sync
            if self._in_flight is in_flight:  # no later step launched: nothing is in flight any more
                self._in_flight = None
            request_ids = batch.sample_request_ids
            logprobs = {} if result.logprobs is None else {
                rid: entries for rid, entries in zip(request_ids, result.logprobs) if entries is not None
            }
            return ModelOutput(self.peers.share_sampled(dict(zip(request_ids, result.token_ids))), logprobs)

        return tokens

    def _prompt_logprobs(self, batch: InputBatch, hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        logprobs = {}
        for rows in batch.prompt_logprobs:
            logits = self.model.compute_logits(hidden[rows.rows])  # under TP every rank joins the head
            if self.peers.is_driver:
                logprobs[rows.request_id] = self.sampler.prompt_logprobs(logits, rows.target_ids, rows.num_top)
        return logprobs


def _return_freed_memory(device: torch.device) -> None:
    """Collect what the references just dropped held (cycles too), and on CUDA give the cache's blocks back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
