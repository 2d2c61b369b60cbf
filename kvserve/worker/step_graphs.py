"""Which step graphs serve a model's decode steps: CPU step graphs (``worker/cpu_graph.py``), recorded at each
batch size's first step, or CUDA graphs (``worker/cuda_graph.py``), captured at start-up for a ladder of sizes."""

from __future__ import annotations

from typing import Protocol

import torch

from kvserve.attention.backend import AttentionBackend, AttentionInputs
from kvserve.kv.storage import KVCacheStorage
from kvserve.model.layers.lora import LoRAMapping
from kvserve.model.layers.rotary import rope_table_positions
from kvserve.worker.cpu_graph import CpuStepGraphs
from kvserve.worker.cuda_graph import CudaStepGraphs


class StepGraphs(Protocol):
    num_replays: int  # steps served by a graph

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                lora: LoRAMapping | None = None) -> torch.Tensor | None:
        """The hidden states of a forward pass over these inputs (and the step's LoRA adapters), or None where the
        step must run eagerly."""


def captures_cuda_graphs(model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                         enforce_eager: bool, max_running: int) -> bool:
    """Whether ``step_graphs_for`` captures CUDA graphs for this model: its KV cache then needs a scratch block
    for padding rows (``KVCacheStorage(scratch_block=True)``). Not for weights streamed from host memory
    (``model.weight_streamer``): their copies wait on events across streams, which no graph captures."""
    return (device.type == "cuda" and device.type in backend.graph_devices and not enforce_eager
            and max_running > 0 and model.weight_streamer is None)


def step_graphs_for(model: torch.nn.Module, backend: AttentionBackend, kv: KVCacheStorage, device: torch.device,
                    max_blocks: int, enforce_eager: bool, group_windows: list[set[int | None]] | None = None,
                    layer_groups: tuple[int, ...] = (), max_running: int = 0) -> StepGraphs | None:
    """Step graphs for ``model``'s decode steps where they can serve, unless ``--enforce-eager``: over a backend
    whose steps that device's graphs replay (``AttentionBackend.graph_devices``), on CPU, or on CUDA where
    ``captures_cuda_graphs`` (``kv`` then has its scratch block). ``group_windows`` and ``layer_groups``
    describe KV cache groups (``build_step_metadata``); None: one group."""
    if enforce_eager or device.type not in backend.graph_devices:
        return None
    windows = group_windows or [model.sliding_windows()]
    if device.type == "cpu":
        return CpuStepGraphs(model, backend, kv, windows, max_blocks, rope_table_positions(model.config),
                             layer_groups)
    if captures_cuda_graphs(model, backend, device, enforce_eager, max_running):
        return CudaStepGraphs(model, backend, kv, windows, layer_groups, max_blocks, max_running)
    return None
