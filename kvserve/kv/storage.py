"""KVCacheStorage: the paged K and V tensors of every layer, in a layout the storage owns.

The backends write a step's new keys and values through ``write`` and read a layer through ``layer(i)``, a
``KVLayerView``; how elements are encoded (``KVCacheDtype``: the model's own dtype, or int8 / fp8 / int4 with
parameters per group of a token's row of one KV head, and int4's keys rotated, ``kv/quant.py``) is known here and in the kernels that read a view, never in
the scheduler or the model. ``write`` quantizes; ``KVLayerView.gather_rows`` dequantizes for the reference
backend, and the C kernels dequantize as they read. Layout per paged tensor (one per layer, or per
``group_size`` layers of KV cache groups, ``kv/groups.py``, whose layers share them through their own blocks),
where a token's flat slot is ``block_id * block_size + offset``::

    k, v:              [num_blocks, block_size, num_kv_heads, head_dim // values_per_element]  (data dtype)
    k_scale, v_scale:  [num_blocks, block_size, num_kv_heads, params_per_row]  (scale dtype; quantized only)

A quantized block is smaller (``KVCacheSpec.bytes_per_block`` counts data and parameters), so the same memory
budget holds more blocks; the scheduler never sees these tensors, only block ids.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvserve.kv.cpu_store import cpu_kv_store
from kvserve.kv.quant import KVCacheDtype, dequantize, quantize


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of the KV cache and how it is encoded; ``bytes_per_block`` sizes the block pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the model's: what ``write`` takes and what reads give back
    cache_dtype: KVCacheDtype | None = None  # None: ``dtype`` itself, unquantized
    # per layer: the paged tensor it reads and writes (``kv/groups.py``: layers of different KV cache groups
    # share tensors, each through its own group's blocks); () gives every layer a tensor of its own
    layer_tensors: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        sizes = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                 "block_size": self.block_size}
        if any(n < 1 for n in sizes.values()):
            raise ValueError(f"every KV cache size must be >= 1, got {sizes}")
        if self.layer_tensors and len(self.layer_tensors) != self.num_layers:
            raise ValueError(f"layer_tensors names {len(self.layer_tensors)} layers, the cache has {self.num_layers}")
        if self.head_dim % self.kv_dtype.values_per_element:
            raise ValueError(f"head_dim={self.head_dim} does not pack into {self.kv_dtype.name!r} elements "
                             f"of {self.kv_dtype.values_per_element} values")

    @property
    def kv_dtype(self) -> KVCacheDtype:
        """The encoding of the stored K and V."""
        return self.cache_dtype or KVCacheDtype.unquantized(self.dtype)

    @property
    def num_tensors(self) -> int:
        """The paged K/V tensor pairs: one per layer, or fewer where groups share them."""
        return max(self.layer_tensors) + 1 if self.layer_tensors else self.num_layers

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every paged tensor: K and V data plus their scales."""
        token_head_bytes = self.kv_dtype.bytes_per_token_head(self.head_dim)
        return 2 * self.num_tensors * self.block_size * self.num_kv_heads * token_head_bytes


class KVLayerView(NamedTuple):
    """One layer's paged K and V, as the backends read them (layout in the module docstring). The tensors are
    the storage's own: a kernel may take their pointers, but only ``KVCacheStorage.write`` changes them."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None  # None: unquantized
    v_scale: torch.Tensor | None
    encoding: KVCacheDtype
    dtype: torch.dtype  # the model's: what reads give back

    def gather_rows(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy K and V rows, dequantized, into ``out`` ([2, len(rows), head_dim]: K, then V) and return it. Row
        r is (slot r // num_kv_heads, KV head r % num_kv_heads), so a backend picks its own order of heads and
        keys."""
        for i, (data, params) in enumerate(((self.k, self.k_scale), (self.v, self.v_scale))):  # K, then V
            stored = _as_copyable(data).view(-1, data.shape[-1])
            if params is None:
                torch.index_select(stored, 0, rows, out=out[i])
            else:
                codes = stored.index_select(0, rows).view(data.dtype)
                row_params = params.view(-1, params.shape[-1]).index_select(0, rows)
                out[i].copy_(dequantize(codes, row_params, self.encoding, out.dtype, keys=i == 0))
        return out

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given flat slots, dequantized: two [len(slots), num_kv_heads, head_dim] tensors."""
        num_kv_heads = self.k.shape[-2]
        head_dim = self.k.shape[-1] * self.encoding.values_per_element
        heads = torch.arange(num_kv_heads, device=slots.device)
        rows = (slots.unsqueeze(-1) * num_kv_heads + heads).flatten()
        out = torch.empty(2, rows.numel(), head_dim, dtype=self.dtype, device=self.k.device)
        keys, values = self.gather_rows(rows, out).view(2, -1, num_kv_heads, head_dim)
        return keys, values

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the layer: data, and parameters where quantized."""
        return tuple(t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros; on CPU in anonymous mapped memory, whose pages the OS hands out zeroed when first
    touched: a pool of gigabytes then costs nothing at start-up (``torch.zeros`` writes every byte, 0.5 s for the
    default 2 GB), and blocks never used take no memory."""
    if torch.device(device).type != "cpu" or not math.prod(shape):
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    try:
        mapped = mmap.mmap(-1, size)  # the tensor keeps the mapping alive
    except OSError as error:  # ENOMEM: an address-space limit (ulimit -v) below the pool, which errno alone hid
        raise ValueError(f"could not map {size / 2**30:.2f} GiB of the KV cache: {error.strerror}; lower "
                         "--kv-cache-memory or --num-kv-blocks") from None
    return torch.frombuffer(mapped, dtype=torch.uint8).view(dtype).view(shape)


def _as_copyable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bytes where torch's CPU copy ops do not take its dtype (float8), else ``t`` itself."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class KVCacheStorage:
    """Owns the paged K/V tensors of every layer, stored in the spec's encoding (quantized in ``write``)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str,
                 scratch_block: bool = False) -> None:
        """``num_blocks`` blocks for block tables to name; with ``scratch_block`` one more that none names, whose
        slots (from ``scratch_slot``) take the K/V of a captured step's padding rows (``worker/cuda_graph.py``)."""
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got num_blocks={num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self._num_allocated = num_blocks + scratch_block
        self._tensors = [self._new_layer(device) for _ in range(spec.num_tensors)]
        # layer -> its paged tensors: a list lookup, so that sharing tensors costs a layer's read nothing
        self._layers = [self._tensors[t] for t in spec.layer_tensors or range(spec.num_layers)]

    def _new_layer(self, device: torch.device | str) -> KVLayerView:
        spec, encoding = self.spec, self.spec.kv_dtype
        shape = (self._num_allocated, spec.block_size, spec.num_kv_heads)
        data_shape = (*shape, spec.head_dim // encoding.values_per_element)
        k, v = (zeros(data_shape, encoding.data_dtype, device) for _ in "kv")
        k_scale = v_scale = None
        if encoding.scale_dtype is not None:
            params_shape = (*shape, encoding.params_per_row(spec.head_dim))
            k_scale, v_scale = (zeros(params_shape, encoding.scale_dtype, device) for _ in "kv")
        return KVLayerView(k, v, k_scale, v_scale, encoding, spec.dtype)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def scratch_slot(self) -> int:
        """The first slot of the scratch block (ValueError without one)."""
        if self._num_allocated == self.num_blocks:
            raise ValueError("this KV cache has no scratch block")
        return self.num_slots

    def layer(self, layer: int) -> KVLayerView:
        """Layer ``layer``'s paged K and V, for a backend to read."""
        if not 0 <= layer < self.spec.num_layers:
            raise IndexError(f"layer {layer} is outside the cache's {self.spec.num_layers} layers")
        return self._layers[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys and values ([T, num_kv_heads, head_dim], the model's dtype) of layer
        ``layer`` at their flat slots (int64 [T]), as vLLM's ``reshape_and_cache``.

        A slot outside the cache raises ``ValueError`` on CPU (the C store checks every slot first and stores
        nothing; the torch path's copy checks its own bounds, so the keys of the slots before the bad one may
        already be stored there); on CUDA the copy kernel asserts (checking first would cost a host sync per
        layer).
        """
        self._check_write(slot_mapping, k, v)
        view = self.layer(layer)
        store = cpu_kv_store() if view.k.device.type == "cpu" else None
        if store is not None and store.takes(view.k, view.k_scale, k, v, view.encoding.name):
            store(view.k, view.v, view.k_scale, view.v_scale, slot_mapping, k, v, view.encoding.name)
        else:
            self.write_by_torch(view, slot_mapping, k, v)

    def write_by_torch(self, view: KVLayerView, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``write`` in torch ops (``quantize``, then ``index_copy_``): every device, and the twin of the CPU store
        (``kv/cpu_store.py``), which gives the same bytes."""
        try:
            for keys, new, data, params in ((True, k, view.k, view.k_scale), (False, v, view.v, view.v_scale)):
                if params is None:
                    data.view(-1, *data.shape[2:]).index_copy_(0, slot_mapping, new)
                    continue
                codes, new_params = quantize(new, view.encoding, keys)
                _as_copyable(data).view(-1, *data.shape[2:]).index_copy_(0, slot_mapping, _as_copyable(codes))
                params.view(-1, *params.shape[2:]).index_copy_(0, slot_mapping, new_params)
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
        """Apply (src, dst) block copies in every paged tensor (copy-on-write of a shared partial block)."""
        if not copies:
            return
        device = self._tensors[0].k.device
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
        for view in self._tensors:
            for paged in map(_as_copyable, view.tensors()):
                paged.index_copy_(0, dst, paged.index_select(0, src))

    @property
    def nbytes(self) -> int:
        return self.spec.bytes_per_block * self.num_blocks

    def read_blocks(self, block_ids: list[int], out: torch.Tensor, rows: list[int]) -> None:
        """Copy whole blocks, every paged tensor's data and parameters as stored, into rows of ``out`` (uint8
        ``[*, bytes_per_block]``, e.g. a host tier's slab): the bytes a tier keeps and ``write_blocks`` puts
        back bit for bit. Row layout: each tensor's K, V (then K, V parameters) of the block, in order."""
        self._move_blocks(block_ids, out, rows, into_cache=False)

    def write_blocks(self, block_ids: list[int], src: torch.Tensor, rows: list[int]) -> None:
        """Overwrite blocks with rows of ``src`` written by ``read_blocks`` (a tier's copy coming back)."""
        self._move_blocks(block_ids, src, rows, into_cache=True)

    def _move_blocks(self, block_ids: list[int], host: torch.Tensor, rows: list[int], into_cache: bool) -> None:
        if len(block_ids) != len(rows):
            raise ValueError(f"{len(block_ids)} blocks but {len(rows)} rows")
        if host.dtype != torch.uint8 or host.dim() != 2 or host.shape[1] != self.spec.bytes_per_block:
            raise ValueError(f"block rows must be uint8 [n, {self.spec.bytes_per_block}], got "
                             f"{host.dtype} {tuple(host.shape)}")
        if not block_ids:
            return
        device = self._tensors[0].k.device
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        host_rows = torch.tensor(rows, dtype=torch.long)
        parts, word = self._block_words()
        host_words = host.view(word)
        offset = 0
        for part in parts:
            end = offset + part.shape[1]
            if into_cache:
                part.index_copy_(0, ids, host_words[host_rows, offset:end].to(device, non_blocking=True))
            else:
                host_words[host_rows, offset:end] = part.index_select(0, ids).to(host.device)
            offset = end

    def _block_words(self) -> tuple[list[torch.Tensor], torch.dtype]:
        """Every stored tensor as ``[num_blocks, words of one block]``, in the order of a block's row, in the
        widest integer word that divides every part: the index copies then move words, not bytes (8x faster)."""
        parts = [t.view(torch.uint8).view(self._num_allocated, -1) for view in self._tensors for t in view.tensors()]
        word = next(dtype for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8)
                    if all(part.shape[1] % dtype.itemsize == 0 for part in parts))
        return [part.view(word) for part in parts], word
