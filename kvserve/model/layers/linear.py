"""Linear layers and the seam behind them: a ``Linear`` knows its shapes, its ``LinearMethod`` owns how the
weight is stored, loaded and multiplied (plain, prepacked for CPU GEMMs, and later quantized or sharded).

A layer's life, driven by ``model/registry.py``; the model files only construct layers with their shapes:

    Linear(in, out, bias)        shapes only, no parameters yet
    bind(method, dtype)          the method creates the parameters the checkpoint fills (its shapes and dtypes)
    load_weight(name, tensor)    each checkpoint tensor, through the method (this rank's slice of it under
                                 tensor parallelism: ``tp_shard``, set before ``bind`` by ``tensor_parallel.py``)
    process_weights_after_loading()   the method may re-lay the weights out for its kernels
    forward(x, lora)             method.apply(layer, x), the step's LoRA terms added (``layers/lora.py``), then
                                 the ranks' outputs joined (``tp_shard.join``)

``PackedLinear`` stores several Hugging Face projections of the same input as one weight, so they cost one GEMM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from kvserve.model.layers.ggml import GGMLTensor
    from kvserve.model.layers.lora import LoRAMapping
    from kvserve.model.layers.tensor_parallel import LinearShard

# ``multiply(x [M, K], part, bias, out)``: one kept part's product, into ``out`` (a column range) when given
PartProduct = Callable[[torch.Tensor, Any, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape is not the one its parameter (or the rows of it) expects."""

    def __init__(self, got: torch.Size, expected: torch.Size) -> None:
        super().__init__(f"has shape {list(got)}, but {list(expected)} is expected")
        self.got, self.expected = list(got), list(expected)


def copy_weight(target: torch.Tensor, tensor: torch.Tensor) -> None:
    """``target.copy_(tensor)`` for tensors of the same shape only: broadcasting would hide a wrong checkpoint.
    A checkpoint tensor kept quantized (a GGUF's blocks) is dequantized first: only linear methods keep blocks."""
    tensor = tensor.dequantize()  # a float tensor's is itself
    if tensor.shape != target.shape:
        raise WeightShapeError(tensor.shape, target.shape)
    with torch.no_grad():
        target.copy_(tensor)


class LinearMethod(ABC):
    """How a ``Linear`` stores its weight and computes ``x @ W.T + b``. One method object may serve many
    layers: per-layer state (parameters, re-laid-out weights) lives on the layer, never on the method."""

    @abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        """Register on ``layer`` the parameters its checkpoint tensors load into, named by their checkpoint
        suffix (``weight``, ``bias``; a quantized format has its own), in shapes and dtypes of the method's
        choosing; ``dtype`` is the model's. ``layer.bias`` must be set (None without one)."""

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor, shard: str | None) -> None:
        """Copy checkpoint tensor ``name`` of the projection ``shard`` of a ``PackedLinear`` (None: of the whole
        layer) into its parameter's rows. Raises ``WeightShapeError``. Under tensor parallelism ``tensor`` is
        already this rank's slice (``Linear.load_weight`` narrows it)."""
        param = getattr(layer, name)
        copy_weight(param if shard is None else param[layer.shard_rows()[shard]], tensor)

    def load_tied_weight(self, layer: Linear, tensor: torch.Tensor) -> None:
        """Offered the checkpoint tensor of the embeddings that a tied LM head ``layer`` shares (already its
        weight, as loaded into the embeddings): a method that keeps a checkpoint format of its own may keep it."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Called once after every tensor is loaded: a method may replace the parameters by a layout of its
        kernels' own. A parameter shared with another module (a tied LM head's weight) must be left intact."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features] -> [..., out_features]``, in ``x``'s dtype."""

    def apply_gated(self, layer: Linear, gate_up: torch.Tensor, activation: str,
                    act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``apply(layer, act(gate) * up)`` for a gated MLP's down projection, ``gate_up`` [T, 2 * in_features]
        its packed [gate | up] rows and ``act_and_mul`` the fused ops' product of them. A method whose kernel
        computes the product as it loads its input (named by ``activation``, the config's) overrides this to
        save the product's launch; this one launches it."""
        return self.apply(layer, act_and_mul(gate_up))


class UnquantizedLinearMethod(LinearMethod):
    """The weight as the checkpoint stores it, multiplied by ``F.linear``: the reference every method is
    tested against, and the method of every device and dtype that has no faster one."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        layer.weight = _parameter(layer.out_features, layer.in_features, dtype=dtype)
        layer.bias = _parameter(layer.out_features, dtype=dtype) if layer.has_bias else None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class AsLoadedLinearMethod(LinearMethod):
    """Base of the methods that keep a layer's checkpoint tensors themselves, one per packed projection, instead
    of copying them into a parameter of their own (a GGUF's blocks; views of a mapped file): ``load_weight``
    collects them, ``loaded_parts`` hands them to ``process_weights_after_loading`` in packing order, and
    ``apply_by_parts`` multiplies them where they lie."""

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        # An empty placeholder names the tensor the checkpoint fills; its rows arrive in ``load_weight``.
        layer.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        layer.bias = _parameter(layer.out_features, dtype=dtype) if layer.has_bias else None
        layer.weight_parts = {}

    def load_weight(self, layer: Linear, name: str, tensor: torch.Tensor | GGMLTensor, shard: str | None) -> None:
        if name != "weight":
            return super().load_weight(layer, name, tensor, shard)
        rows = layer.shard_rows()
        expected = (rows[shard].stop - rows[shard].start if shard else layer.out_features, layer.in_features)
        if tuple(tensor.shape) != expected:
            raise WeightShapeError(torch.Size(tensor.shape), torch.Size(expected))
        layer.weight_parts[shard] = tensor

    @staticmethod
    def loaded_parts(layer: Linear) -> list[torch.Tensor | GGMLTensor]:
        """The tensors ``load_weight`` kept, in packing order (none for a tied head, whose weight is the
        embeddings' parameter); once, as ``process_weights_after_loading`` starts."""
        parts = [layer.weight_parts[shard] for shard in (layer.shard_rows() or {None: None})] \
            if layer.weight_parts else []
        del layer.weight_parts
        return parts


def apply_by_parts(layer: Linear, parts: tuple[Any, ...], x: torch.Tensor, multiply: PartProduct) -> torch.Tensor:
    """``x [..., in] @ W.T + b`` for W the ``parts`` (a packed layer's projections) one under the other, never
    joined (joining would copy them): ``multiply`` writes each part's product into its column range of the
    output."""
    num_rows = x.numel() // layer.in_features
    rows = x.reshape(num_rows, layer.in_features)
    if len(parts) == 1:  # no slicing: every op here is replayed by a CPU step graph, each costs
        return multiply(rows, parts[0], layer.bias, None).view(*x.shape[:-1], layer.out_features)
    y = x.new_empty(num_rows, layer.out_features)
    start = 0
    for part in parts:
        stop = start + part.shape[0]
        multiply(rows, part, None if layer.bias is None else layer.bias[start:stop], y[:, start:stop])
        start = stop
    return y.view(*x.shape[:-1], layer.out_features)


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight.T (+ bias)`` by torch's GEMM, into ``out`` [M, N] if given (its rows may be strided:
    a column range of a wider output, written in place)."""
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.T, out=out)
    return torch.addmm(bias, x, weight.T, out=out)


def _parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T + b`` over ``[..., in_features]``, computed by the ``LinearMethod`` bound to the layer."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.method: LinearMethod | None = None
        self.tp_shard: LinearShard | None = None  # this rank's part under tensor parallelism (shapes above are its)
        # LoRA adapters installed on the layer: adapter id -> (A [r, in], B [out, r] scaled), ``layers/lora.py``
        self.lora: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the stacked weights of sets of adapters a step used together (``layers/lora.py``'s masked path)
        self.lora_stacks: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None] = {}

    def bind(self, method: LinearMethod, dtype: torch.dtype) -> None:
        """Give the layer its method, which creates its parameters (on the current default device)."""
        self.method = method
        method.create_weights(self, dtype)

    def shard_rows(self) -> dict[str, slice]:
        """The output rows of each packed projection; a plain Linear packs none."""
        return {}

    def whole_shape(self, projection: str | None) -> tuple[int, int]:
        """(in, out) of ``projection``'s weight (None: the whole layer's) as the checkpoint holds it, whole even
        where this rank holds a part of it."""
        if self.tp_shard is not None:
            return self.tp_shard.whole_shapes[projection]
        rows = self.shard_rows()[projection] if projection else slice(0, self.out_features)
        return self.in_features, rows.stop - rows.start

    def load_weight(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        if self.tp_shard is not None:
            tensor = self.tp_shard.narrow(tensor, shard)
        self.method.load_weight(self, name, tensor, shard)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        y = self.method.apply(self, x)
        return self._joined(y if lora is None else lora.add(self, x, y))

    def forward_gated(self, gate_up: torch.Tensor, activation: str,
                      act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``forward(act_and_mul(gate_up))``, the product left to the method (``LinearMethod.apply_gated``)."""
        return self._joined(self.method.apply_gated(self, gate_up, activation, act_and_mul))

    def _joined(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.tp_shard is None else self.tp_shard.join(y)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
                f"method={type(self.method).__name__}")


class PackedLinear(Linear):
    """A Linear whose output rows are the concatenation of named Hugging Face projections.

    ``shards`` maps each HF projection name (``q_proj``) to its number of output rows, in packing order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self.shards = dict(shards)

    def shard_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, size in self.shards.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows


def linear_from_tensors(weight: torch.Tensor, bias: torch.Tensor | None, method: LinearMethod) -> Linear:
    """A ready Linear holding ``weight [out, in]`` and ``bias`` through ``method``: the life a model's layers
    go through at load, for benchmarks and tests of one layer; on the weight's device."""
    with torch.device(weight.device):
        layer = Linear(weight.shape[1], weight.shape[0], bias is not None)
        layer.bind(method, weight.dtype)
    layer.load_weight("weight", weight)
    if bias is not None:
        layer.load_weight("bias", bias)
    layer.process_weights_after_loading()
    return layer
