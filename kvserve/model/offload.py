"""Weight offload (``--cpu-offload-gb``, vLLM's flag): a model larger than device memory runs with the weights of
some decoder layers kept in host memory and streamed to the device just before each of those layers runs, as
ZeRO-Inference does.

The last decoder layers are offloaded, as many as the budget covers (every decoder layer of a family has the same
shapes). Their tensors live in pinned host memory; two device slots, each shaped like one layer, take turns: while
offloaded layer i computes out of one slot, layer i + 1's weights are copied into the other on a copy stream, and
the first offloaded layer's copy starts when the first decoder layer does, so each copy overlaps a layer's
compute. Before a slot is overwritten the copy stream waits for the layer that last used it to finish. A step
with many tokens computes longer per layer, so large batches hide the transfers; at one token a step is bound by
the host link's bandwidth (an offloaded layer's bytes / PCIe GB/s).

Parameters are re-pointed at the slot a layer runs from (``param.data``), so the model code does not change. On
a CPU device there is nothing to offload to (the engine refuses the flag there); the mechanism still runs, with
synchronous copies, which is how it is tested without a GPU.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from torch import nn

logger = logging.getLogger(__name__)


def layer_bytes(layer: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(layer))


def _tensors(layer: nn.Module) -> list[torch.Tensor]:
    """The tensors a layer computes with, in a fixed order: its parameters, then its buffers."""
    return [*layer.parameters(), *layer.buffers()]


class WeightStreamer:
    """Streams the weights of ``layers[-num_offloaded:]`` from pinned host memory to ``device`` around each
    forward (hooks on the layers); ``layers`` are a model's decoder layers, all of one shape, loaded on the CPU
    (the caller then moves the rest of the model to ``device``)."""

    def __init__(self, layers: nn.ModuleList, device: torch.device, num_offloaded: int) -> None:
        self.device = device
        self.layers = list(layers)
        self.first = len(self.layers) - num_offloaded
        offloaded = self.layers[self.first :]
        pin = device.type == "cuda"
        self.host = [[t.detach().pin_memory() if pin else t.detach().clone() for t in _tensors(layer)]
                     for layer in offloaded]
        self.slots = [[torch.empty_like(t, device=device) for t in self.host[0]] for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copied = [None, None]  # per slot: the event its last copy recorded
        self.released = [None, None]  # per slot: the event the last layer computing from it recorded
        for layer in offloaded:  # the loaded copies are dropped: the slots stand in for them
            for tensor in _tensors(layer):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
        self.layers[0].register_forward_pre_hook(lambda module, args: self._copy(0))
        for i, layer in enumerate(offloaded):
            layer.register_forward_pre_hook(lambda module, args, i=i: self._enter(i))
            layer.register_forward_hook(lambda module, args, output, i=i: self._leave(i))

    @property
    def num_offloaded(self) -> int:
        return len(self.host)

    def _copy(self, i: int) -> None:
        """Start copying offloaded layer i's weights into its slot (i % 2), after that slot's last reader."""
        slot = i % 2
        stream = self.copy_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if stream is not None and self.released[slot] is not None:
                stream.wait_event(self.released[slot])
            for target, source in zip(self.slots[slot], self.host[i]):
                target.copy_(source, non_blocking=stream is not None)
            self.copied[slot] = _record(stream)

    def _enter(self, i: int) -> None:
        slot = i % 2
        if self.copied[slot] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        for tensor, source in zip(_tensors(self.layers[self.first + i]), self.slots[slot]):
            tensor.data = source
        if i + 1 < self.num_offloaded:
            self._copy(i + 1)

    def _leave(self, i: int) -> None:
        self.released[i % 2] = _record(torch.cuda.current_stream(self.device) if self.copy_stream else None)


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def offload_weights(layers: nn.ModuleList, device: torch.device, budget_bytes: int) -> WeightStreamer | None:
    """Offload the last decoder layers whose bytes fit in ``budget_bytes`` (at least one layer's worth is needed;
    None for a budget under one layer's bytes)."""
    per_layer = layer_bytes(layers[0])
    num_offloaded = min(len(layers) - 1, budget_bytes // per_layer) if per_layer else 0
    if num_offloaded < 1:
        return None
    streamer = WeightStreamer(layers, device, int(num_offloaded))
    logger.info("weight offload: the last %d of %d decoder layers (%.2f GiB) stream from pinned host memory",
                streamer.num_offloaded, len(layers), streamer.num_offloaded * per_layer / 2**30)
    return streamer
