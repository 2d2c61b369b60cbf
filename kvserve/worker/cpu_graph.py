"""CPU step graphs: a decode step's forward recorded once per batch size, then replayed without the Python that
made it, as a CUDA graph replays a step's kernels on a GPU.

Why: at one stream a SmolLM2 decode step on two Zen 2 cores spent ~10 ms of its ~24 ms forward in Python between
the kernels (module calls, argument checks, views, ctypes conversions: ~300 us a layer), where the kernels
themselves take ~14 ms. Replayed, a step is the kernels and a few microseconds of Python per call.

Recording runs the step eagerly (its output is that step's output) with two observers:

- ``kvserve.native.recording``: every C kernel call (``KernelFunction``), replayed with the same arguments, raw
  pointers into tensors that the graph keeps alive;
- a ``TorchDispatchMode``: every aten op. ``empty`` and ops that returned a view of an input need no replay (the
  graph keeps their tensors, so no pointer is ever handed to anything else); an op that computes (the embedding lookup, the rope gather, the
  KV write, a twin's elementwise ops) is replayed on the same tensors and its result copied into the tensor it
  returned at recording (an in-place op's result is its input: nothing to copy). An op that hands a value to
  Python (``.item()``, ``.tolist()``) makes the step unreplayable: that batch size stays eager.

The step's inputs live in static tensors (token ids, positions, slots, sequence lengths, block tables as wide as
the longest context), filled from each step's batch before a replay; the attention metadata is built once from
them, so only a backend whose metadata reads nothing but those tensors (``AttentionBackend.graph_devices``)
can be replayed. Steps of up to ``MAX_GRAPH_TOKENS`` decodes are recorded, each size at its first occurrence
(at more tokens the kernels' time dwarfs the Python's), while the graphs' own tensors (every intermediate result
of a step, none reused: ~1 MB a token for SmolLM2) stay within ``MAX_GRAPH_BYTES``; a size past it stays eager.
``--enforce-eager`` turns graphs off.

A step with LoRA adapters is recorded once per size and set of adapters, on the masked path
(``LoRAMapping.with_token_groups``): which token runs with which of them is a static tensor of the graph's, loaded
before each replay, and the mask is recomputed from it; the adapters' stacked weights are the graph's. The step is
run once before it is recorded, so that those stacks are made outside the recording (made inside it, their copies
would be replayed every step). Installing or removing an adapter drops the graphs recorded with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvserve.attention.backend import AttentionBackend, AttentionInputs, build_step_metadata
from kvserve.kv.storage import KVCacheStorage
from kvserve.model.layers.lora import LoRAMapping
from kvserve.native import KernelFunction, recording
from kvserve.worker.static_inputs import StaticStepInputs

logger = logging.getLogger(__name__)

MAX_GRAPH_TOKENS = 16
MAX_GRAPH_BYTES = 256 << 20
# ops that only allocate: the recorded tensor is the replay's (Gemma 3's step made 9 ``new_empty`` a step, each
# replayed and its uninitialised memory copied)
_NOT_REPLAYED = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                 torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
                 torch.ops.aten.empty_like.default}


class UnreplayableStep(RuntimeError):
    """The recorded step did something a replay cannot repeat (handed a tensor's value to Python)."""


@dataclass(frozen=True)
class _KernelCall:
    function: KernelFunction
    args: tuple

    def __call__(self) -> None:
        status = self.function.function(*self.args)
        if status:  # the kernels return 0 or None when all is well
            raise RuntimeError(f"{self.function.name} returned {status} in a replayed step")


@dataclass(frozen=True)
class _TorchOp:
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    copy_into: tuple[tuple[int, torch.Tensor], ...]  # (index among the flat outputs, the recorded output)

    def __call__(self) -> None:
        result = self.op(*self.args, **self.kwargs)
        if not self.copy_into:  # in place (the KV write): nothing to move, no outputs to flatten
            return
        outputs = (result,) if isinstance(result, torch.Tensor) else tree_flatten(result)[0]
        for index, recorded in self.copy_into:
            recorded.copy_(outputs[index])


class _StepRecorder(TorchDispatchMode):
    """Collects a step's replayable calls, in order, and keeps every tensor the step made alive."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Callable[[], None]] = []
        self.tensors: list[Any] = []
        self.num_bytes = 0  # of the tensors the step allocated (views of weights or KV are not the graph's)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch then leaves ``__torch_dispatch__`` as it is, not wrapped to keep torch.compile out of it
        (which imports torch._dynamo at the first call: 2-3 s of the first step on a small CPU); no step is
        compiled while one is recorded. torch's own opt-out (``TorchDispatchMode._should_skip_dynamo``)."""
        return False

    def record_kernel(self, function: KernelFunction, args: tuple) -> None:
        self.calls.append(_KernelCall(function, function.converted(args)))

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = op(*args, **kwargs)
        self.tensors.append(result)
        if op in _NOT_REPLAYED:
            self.num_bytes += result.untyped_storage().nbytes()
            return result
        outputs, _ = tree_flatten(result)
        if not all(isinstance(out, torch.Tensor) for out in outputs):
            raise UnreplayableStep(f"{op} hands a value to Python")
        if not all(out.layout == torch.strided for out in outputs):
            raise UnreplayableStep(f"{op} returns a tensor without plain storage")
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        copy_into = tuple((i, out) for i, out in enumerate(outputs) if _storage(out) not in inputs)
        self.num_bytes += sum(out.untyped_storage().nbytes() for _, out in copy_into)
        # an op that may alias (a view, and under inference mode ``to`` and ``reshape``) needs no replay where it
        # did alias; where it copied, it is replayed like any other
        if not (op.is_view and not copy_into):
            self.calls.append(_TorchOp(op, args, kwargs, copy_into))
        return result


def _storage(t: torch.Tensor) -> int | None:
    """Where ``t``'s memory starts (None for a tensor without plain storage, such as an opaque oneDNN one)."""
    return t.untyped_storage().data_ptr() if t.layout == torch.strided else None


# a graph's key: the step's size and the LoRA adapters it was recorded with (none: ())
GraphKey = tuple[int, tuple[int, ...]]


class _StepGraph:
    """One batch size's recorded forward (with one set of LoRA adapters): its static inputs (with adapters, each
    token's group among them too), its calls, its output tensor and the bytes it holds."""

    def __init__(self, inputs: StaticStepInputs, calls: list[Callable[[], None]], tensors: list[Any],
                 keep: tuple, output: torch.Tensor, num_bytes: int, token_groups: torch.Tensor | None) -> None:
        self.inputs, self.calls, self.output, self.num_bytes = inputs, calls, output, num_bytes
        self.token_groups = token_groups
        self._alive = (tensors, keep)  # every tensor a recorded pointer may point into

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
               lora: LoRAMapping | None) -> torch.Tensor:
        self.inputs.load(input_ids, positions, attn)
        if lora is not None:
            assert self.token_groups is not None
            self.token_groups.copy_(lora.token_group_ids(attn.num_tokens, self.token_groups.device))
        for call in self.calls:
            call()
        return self.output


class CpuStepGraphs:
    """Runs decode steps of up to ``MAX_GRAPH_TOKENS`` tokens through step graphs, recording each batch size (and
    set of LoRA adapters) at its first step; ``forward`` returns None for a step that must run eagerly."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv: KVCacheStorage,
                 group_windows: list[set[int | None]], max_blocks: int, max_positions: int,
                 layer_groups: tuple[int, ...] = ()) -> None:
        self.model, self.backend, self.kv = model, backend, kv
        self.group_windows, self.layer_groups = group_windows, layer_groups
        self.max_blocks = max_blocks
        self.max_positions = max_positions  # rope tables cover these positions; a step past them runs eagerly
        self.graphs: dict[GraphKey, _StepGraph] = {}
        self.eager_sizes: set[GraphKey] = set()
        self.num_bytes = 0
        self.num_replays = 0
        self._num_threads = torch.get_num_threads()  # what the recorded kernel calls ask for

    def clear(self) -> None:
        """Drop every recorded step (the model's layers changed what they run): each size is recorded again at
        its next step."""
        self.graphs.clear()
        self.eager_sizes.clear()
        self.num_bytes = 0

    def forget_adapter(self, adapter_id: int) -> None:
        """Drop the steps recorded with LoRA adapter ``adapter_id`` (installed anew or removed: their stacked weights
        are its old ones)."""
        for key in [key for key in self.graphs if adapter_id in key[1]]:
            self.num_bytes -= self.graphs.pop(key).num_bytes
        self.eager_sizes = {key for key in self.eager_sizes if adapter_id not in key[1]}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                lora: LoRAMapping | None = None) -> torch.Tensor | None:
        """The hidden states of a forward pass over these inputs (and the step's LoRA adapters), or None where the
        step must run eagerly."""
        if torch.get_num_threads() != self._num_threads:  # a kernel call's recorded thread count was the old one
            self.clear()
            self._num_threads = torch.get_num_threads()
        num_tokens = attn.num_tokens
        key = (num_tokens, () if lora is None else lora.adapter_ids)
        if (num_tokens > MAX_GRAPH_TOKENS or attn.num_decodes != num_tokens or attn.num_seqs != num_tokens
                or key in self.eager_sizes or max(attn.seq_lens_list) > self.max_positions):
            return None
        graph = self.graphs.get(key)
        if graph is None:
            return self._record(input_ids, positions, attn, lora, key)
        self.num_replays += 1
        return graph.replay(input_ids, positions, attn, lora)

    def _record(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                lora: LoRAMapping | None, key: GraphKey) -> torch.Tensor | None:
        num_tokens = attn.num_tokens
        inputs = StaticStepInputs.allocate(num_tokens, self.max_blocks, attn.block_size, input_ids.device,
                                           1 + len(attn.groups))
        inputs.load(input_ids, positions, attn)
        meta = build_step_metadata(self.backend, inputs.attention_inputs(attn.seq_lens_list), self.group_windows,
                                   self.layer_groups)
        token_groups = None
        if lora is not None:  # run once unrecorded: the adapters' stacks made (its K/V writes are the recording's)
            token_groups = lora.token_group_ids(num_tokens, input_ids.device).clone()
            self.model(inputs.input_ids, inputs.positions, meta, self.kv, lora.with_token_groups(token_groups))
        recorder = _StepRecorder()
        try:
            with recorder, recording(recorder.record_kernel):  # a mapping of its own: its masks made in the recording
                mapping = None if token_groups is None or lora is None else lora.with_token_groups(token_groups)
                output = self.model(inputs.input_ids, inputs.positions, meta, self.kv, mapping)
        except UnreplayableStep as error:
            logger.info("decode steps of %d tokens (LoRA adapters %s) run eagerly: %s", num_tokens, key[1], error)
            self.eager_sizes.add(key)
            return None
        if self.num_bytes + recorder.num_bytes > MAX_GRAPH_BYTES:
            logger.info("decode steps of %d tokens (LoRA adapters %s) run eagerly: the step graphs would hold more "
                        "than %d MiB", num_tokens, key[1], MAX_GRAPH_BYTES >> 20)
            self.eager_sizes.add(key)
            return output  # the recording ran the step: its output stands
        self.num_bytes += recorder.num_bytes
        self.graphs[key] = _StepGraph(inputs, recorder.calls, recorder.tensors, (meta,), output, recorder.num_bytes,
                                      token_groups)
        return output
