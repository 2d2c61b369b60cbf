"""KVCacheStorage: the paged K and V tensors of every layer, in a layout the storage owns.

The backends write a step's new keys and values through ``write`` and read a layer through ``layer(i)``, a
``KVLayerView``; how elements are encoded (``KVCacheDtype``: today the model's own dtype, later packed
int8 / fp8 / int4 with scales) is known here and in the kernels that read a view, never in the scheduler or
the model. Layout per layer, where a token's flat slot is ``block_id * block_size + offset``::

    k, v:              [num_blocks, block_size, num_kv_heads, head_dim // values_per_element]  (data dtype)
    k_scale, v_scale:  [num_blocks, block_size, num_kv_heads]  (scale dtype; quantized encodings only)

The scheduler never sees these tensors, only block ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheDtype:
    """How stored K and V elements are encoded: a data dtype holding ``values_per_element`` values each
    (2 for int4 packed in uint8), and, for quantized encodings, one scale per token per KV head."""

    name: str  # what flags and stats call it: "float32", "bfloat16", and later "int8", "fp8_e4m3", "int4"
    data_dtype: torch.dtype
    scale_dtype: torch.dtype | None = None  # None: unquantized, the data are the values themselves
    values_per_element: int = 1

    def __post_init__(self) -> None:
        if self.values_per_element < 1:
            raise ValueError(f"values_per_element must be >= 1, got {self.values_per_element}")
        if self.scale_dtype is None and (self.values_per_element != 1 or not self.data_dtype.is_floating_point):
            raise ValueError(f"KV dtype {self.name!r}: only float data may be stored without scales, one value each")

    @classmethod
    def unquantized(cls, dtype: torch.dtype) -> KVCacheDtype:
        """The values stored as they are, in ``dtype``."""
        return cls(_dtype_name(dtype), dtype)

    @property
    def has_scales(self) -> bool:
        return self.scale_dtype is not None

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes that one token's K (or V) of one KV head takes: its data plus its scale."""
        scale_bytes = _element_size(self.scale_dtype) if self.scale_dtype is not None else 0
        return head_dim // self.values_per_element * _element_size(self.data_dtype) + scale_bytes


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of the KV cache and how it is encoded; ``bytes_per_block`` sizes the block pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's: what ``write`` takes and what reads give back
    cache_dtype: KVCacheDtype | None = None  # None: ``dtype`` itself, unquantized

    def __post_init__(self) -> None:
        sizes = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                 "block_size": self.block_size}
        if any(n < 1 for n in sizes.values()):
            raise ValueError(f"every KV cache size must be >= 1, got {sizes}")
        if self.head_dim % self.kv_dtype.values_per_element:
            raise ValueError(f"head_dim={self.head_dim} does not pack into {self.kv_dtype.name!r} elements "
                             f"of {self.kv_dtype.values_per_element} values")

    @property
    def kv_dtype(self) -> KVCacheDtype:
        """The encoding of the stored K and V."""
        return self.cache_dtype or KVCacheDtype.unquantized(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every layer: K and V data plus their scales."""
        token_head_bytes = self.kv_dtype.bytes_per_token_head(self.head_dim)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * token_head_bytes


class KVLayerView(NamedTuple):
    """One layer's paged K and V, as the backends read them (layout in the module docstring). The tensors are
    the storage's own: a kernel may take their pointers, but only ``KVCacheStorage.write`` changes them."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None  # None: unquantized
    v_scale: torch.Tensor | None

    def gather_rows(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy K and V rows into ``out`` ([2, len(rows), head_dim]: K, then V) and return it. Row r is
        (slot r // num_kv_heads, KV head r % num_kv_heads), so a backend picks its own order of heads and keys."""
        head_dim = self.k.shape[-1]
        torch.index_select(self.k.view(-1, head_dim), 0, rows, out=out[0])
        torch.index_select(self.v.view(-1, head_dim), 0, rows, out=out[1])
        return out

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given flat slots: two [len(slots), num_kv_heads, head_dim] tensors."""
        num_kv_heads, head_dim = self.k.shape[-2:]
        heads = torch.arange(num_kv_heads, device=slots.device)
        rows = (slots.unsqueeze(-1) * num_kv_heads + heads).flatten()
        out = self.k.new_empty(2, rows.numel(), head_dim)
        keys, values = self.gather_rows(rows, out).view(2, -1, num_kv_heads, head_dim)
        return keys, values


class KVCacheStorage:
    """Owns the paged K/V tensors of every layer; stores the model's dtype unquantized (``KVCacheDtype``
    describes the quantized encodings, which need their quantize step before they can be stored)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> None:
        if spec.kv_dtype != KVCacheDtype.unquantized(spec.dtype):
            raise ValueError(f"KVCacheStorage stores the model's dtype ({_dtype_name(spec.dtype)}) unquantized; "
                             f"KV dtype {spec.kv_dtype.name!r} is not supported yet")
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got num_blocks={num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self._layers = [
            KVLayerView(torch.zeros(shape, dtype=spec.dtype, device=device),
                        torch.zeros(shape, dtype=spec.dtype, device=device), None, None)
            for _ in range(spec.num_layers)
        ]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    def layer(self, layer: int) -> KVLayerView:
        """Layer ``layer``'s paged K and V, for a backend to read."""
        if not 0 <= layer < self.spec.num_layers:
            raise IndexError(f"layer {layer} is outside the cache's {self.spec.num_layers} layers")
        return self._layers[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys and values ([T, num_kv_heads, head_dim], the model's dtype) of layer
        ``layer`` at their flat slots (int64 [T]), as vLLM's ``reshape_and_cache``.

        A slot outside the cache raises ``ValueError`` on CPU, from the copy's own bounds check (checking
        first would cost a host sync per layer on CUDA, whose copy kernel asserts instead), so the keys of
        the slots before the bad one may already be stored.
        """
        self._check_write(slot_mapping, k, v)
        view = self.layer(layer)
        flat_shape = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        try:
            view.k.view(flat_shape).index_copy_(0, slot_mapping, k)
            view.v.view(flat_shape).index_copy_(0, slot_mapping, v)
        except IndexError as error:
            raise ValueError(f"a slot of the step is outside the cache's {self.num_slots} slots") from error

    def _check_write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        spec = self.spec
        expected = (slot_mapping.shape[0], spec.num_kv_heads, spec.head_dim)
        if slot_mapping.dim() != 1 or k.shape != expected or v.shape != expected:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be {expected}: one row of "
                             f"num_kv_heads x head_dim per slot of slot_mapping {tuple(slot_mapping.shape)}")
        if k.dtype != spec.dtype or v.dtype != spec.dtype or slot_mapping.dtype != torch.long:
            raise TypeError(f"write takes k and v in the model's {spec.dtype} and int64 slots; got k {k.dtype}, "
                            f"v {v.dtype}, slot_mapping {slot_mapping.dtype}")

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Apply (src, dst) block copies in every layer (copy-on-write of a shared partial block)."""
        if not copies:
            return
        device = self._layers[0].k.device
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
        for view in self._layers:
            for paged in view:
                if paged is not None:
                    paged.index_copy_(0, dst, paged.index_select(0, src))

    @property
    def nbytes(self) -> int:
        return self.spec.bytes_per_block * self.num_blocks
