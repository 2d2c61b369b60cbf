"""CUDA step graphs: decode steps captured as CUDA graphs at start-up, one per batch size of a ladder, and
replayed; a step runs through the graph of the smallest captured size that holds it, padded up to it.

Why: a decode step of a small model is launch-bound. SmolLM2-135M's is about 15 kernels a layer over 30
layers; each eager launch costs several microseconds of Python and driver time, far more than the kernel
itself. A replay launches the whole step's kernels in one call.

Every graph reads one set of static inputs (``StaticStepInputs``; a graph of n tokens its first n rows), into
which a step's inputs are copied before the replay. A padding row is token 0 at position 0 with sequence length
0 (the decode kernel reads no key for it) whose K/V go to the cache's scratch block, which no block table names.
The attention metadata of each size is built once, from those tensors, for sequences as long as the longest a
graph serves: the backend's kernels read each step's lengths and tables from the tensors, and only its choice
of how many ways to split the keys (flash-decoding) is fixed at capture (``AttentionBackend.graph_devices``).

The graphs share one memory pool, captured largest first, so they take about the largest one's memory.
``--enforce-eager`` turns graphs off; steps with prefill chunks, with more tokens than the largest size or with
longer sequences than the graphs serve run eagerly, and so does every step if capturing fails (with a warning).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBackend, AttentionInputs, AttentionMetadata, build_step_metadata
from kvserve.kv.storage import KVCacheStorage
from kvserve.model.layers.lora import LoRAMapping
from kvserve.worker.static_inputs import StaticStepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_running: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 128 and every 32 up to 512,
    up to the first that holds ``max_running``: a step pads at most 7 rows up to 64 and under 20% above (a
    decode step's time grows little with its rows while it reads more weight bytes than it computes with)."""
    ladder = [1, 2, 4, *range(8, 64, 8), *range(64, 128, 16), *range(128, MAX_CAPTURE_SIZE + 1, 32)]
    limit = min(max(max_running, 1), MAX_CAPTURE_SIZE)
    return ladder[: bisect.bisect_left(ladder, limit) + 1]


@dataclass(frozen=True)
class _CapturedStep:
    graph: torch.cuda.CUDAGraph
    inputs: StaticStepInputs  # the first rows of the shared set, which this graph reads
    output: torch.Tensor  # the hidden states the replay writes
    meta: AttentionMetadata  # kept alive: the graph reads its tensors


class CudaStepGraphs:
    """Decode steps of up to ``max_running`` sequences (capped at ``MAX_CAPTURE_SIZE``) through CUDA graphs
    captured at construction; ``forward`` returns None for a step that must run eagerly."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv: KVCacheStorage,
                 group_windows: list[set[int | None]], layer_groups: tuple[int, ...], max_blocks: int,
                 max_running: int) -> None:
        self.model, self.backend, self.kv = model, backend, kv
        self.sizes = capture_sizes(max_running)
        self.max_seq_len = max_blocks * kv.spec.block_size
        device = kv.layer(0).k.device
        self.inputs = StaticStepInputs.allocate(self.sizes[-1], max_blocks, kv.spec.block_size, device,
                                                max(len(group_windows), 1), padding_slot=kv.scratch_slot)
        self.graphs: dict[int, _CapturedStep] = {}
        self.num_replays = 0
        start = time.perf_counter()
        try:
            self._capture_all(group_windows, layer_groups)
        except RuntimeError as error:  # a model whose forward cannot be captured still serves, eagerly
            logger.warning("decode steps run eagerly: capturing them as CUDA graphs failed: %s", error)
            self.graphs.clear()
            torch.cuda.synchronize()
            return
        logger.info("captured CUDA graphs of decode steps for %d batch sizes (1 .. %d) in %.1f s",
                    len(self.sizes), self.sizes[-1], time.perf_counter() - start)

    @torch.inference_mode()  # as the steps run: no autograd state in the graphs
    def _capture_all(self, group_windows: list[set[int | None]], layer_groups: tuple[int, ...]) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller graphs fit in the pool it leaves
            inputs = self.inputs.prefix(size)
            meta = build_step_metadata(self.backend, inputs.attention_inputs([self.max_seq_len] * size),
                                       group_windows, layer_groups)
            self.model(inputs.input_ids, inputs.positions, meta, self.kv)  # compiles the kernels, outside capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self.model(inputs.input_ids, inputs.positions, meta, self.kv)
            self.graphs[size] = _CapturedStep(graph, inputs, output, meta)
        torch.cuda.synchronize()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                lora: LoRAMapping | None = None) -> torch.Tensor | None:
        """The hidden states of a forward pass over these inputs, or None where the step must run eagerly (a step
        with LoRA adapters: the graphs were captured without them)."""
        num_tokens = attn.num_tokens
        if (lora is not None or num_tokens > self.sizes[-1] or attn.num_decodes != num_tokens
                or attn.num_seqs != num_tokens or max(attn.seq_lens_list) > self.max_seq_len):
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        captured = self.graphs.get(size)
        if captured is None:  # capture failed at start-up
            return None
        captured.inputs.load(input_ids, positions, attn)
        captured.graph.replay()
        self.num_replays += 1
        return captured.output[:num_tokens]
