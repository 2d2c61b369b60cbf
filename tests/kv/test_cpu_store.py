"""The CPU store (kv/csrc/kv_store.c) writes the same bytes as KVCacheStorage's torch path, its twin: raw copies
of every model dtype, int8 / fp8 / int4 quantized bit for bit (rows of every magnitude, all-zero rows, strided
inputs), the machine's build and the AVX2 one; a slot outside the cache stores nothing and names the problem."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.cpu_store import KV_STORE_SOURCE, CpuKVStore
from kvserve.kv.quant import ENCODINGS
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from tests.isa_builds import isa_build

NUM_KV_HEADS, BLOCK_SIZE, NUM_BLOCKS = 3, 4, 5
CACHES = ["float32", "bfloat16", "float16", "int8", "fp8", "int4"]


@pytest.fixture(scope="module", params=["native", "avx2"])
def store(request: pytest.FixtureRequest) -> CpuKVStore:
    return CpuKVStore(isa_build(KV_STORE_SOURCE, request.param))


def _storage(cache: str, head_dim: int) -> KVCacheStorage:
    dtype = getattr(torch, cache) if cache in ("float32", "bfloat16", "float16") else torch.float32
    spec = KVCacheSpec(1, NUM_KV_HEADS, head_dim, BLOCK_SIZE, dtype, ENCODINGS.get(cache))
    return KVCacheStorage(spec, NUM_BLOCKS, "cpu")


def _rows(num_tokens: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, heads, head_dim] of every magnitude, from a wider row (as k and v are views of the qkv output)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_tokens, 2 * NUM_KV_HEADS * head_dim + 5, generator=gen)
    rows = wide[:, 5 : 5 + NUM_KV_HEADS * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    # tiny scales, fp16-clamped ones (past 127 or 448 x fp16's largest: the scale stays 65504), zeros
    magnitudes = torch.tensor([1.0, 1e-6, 3e4, 1e5, 0.0, 1e-3, 7.0, 1e7, 4e7])
    rows.mul_(magnitudes[torch.arange(num_tokens) % len(magnitudes)].view(-1, 1, 1))
    rows[0, 1, : head_dim // 2] = 0.0  # a row half zeros, and row 0's last head all equal
    rows[0, 2] = 0.25
    return rows.to(dtype)


def _stored(kv: KVCacheStorage) -> list[torch.Tensor]:
    return [t.view(torch.uint8).clone() for t in kv.layer(0).tensors()]


@pytest.mark.parametrize("head_dim", [256, 96, 64, 10, 2])  # int4: 4 groups of 64, 3 of 32, 1, 5 of 2
@pytest.mark.parametrize("cache", CACHES)
def test_the_store_writes_the_bytes_of_the_torch_path(store: CpuKVStore, cache: str, head_dim: int) -> None:
    by_store, by_torch = _storage(cache, head_dim), _storage(cache, head_dim)
    view = by_store.layer(0)
    slots = torch.randperm(by_store.num_slots, generator=torch.Generator().manual_seed(head_dim))[:14]
    k, v = (_rows(14, head_dim, by_store.spec.dtype, seed) for seed in (1, 2))
    assert store.takes(view.k, view.k_scale, k, v, view.encoding.name)
    store(view.k, view.v, view.k_scale, view.v_scale, slots, k, v, view.encoding.name)
    by_torch.write_by_torch(by_torch.layer(0), slots, k, v)
    for ours, twin in zip(_stored(by_store), _stored(by_torch)):
        assert torch.equal(ours, twin)


def test_write_takes_the_store_on_cpu_and_reads_back(store: CpuKVStore) -> None:
    kv = _storage("int8", 64)
    slots = torch.tensor([3, 17, 0])
    k, v = (_rows(3, 64, torch.float32, seed) for seed in (3, 4))
    kv.write(0, slots, k, v)
    keys, values = kv.layer(0).gather(slots)
    step = k.abs().amax(-1, keepdim=True) / 127  # int8 moves a value by at most half a step
    assert ((keys - k).abs() <= step / 2 + 1e-6).all() and ((values - v).abs() <= step / 2 + 1e-3).any()


@pytest.mark.parametrize("cache", ["float32", "int4"])
def test_a_slot_outside_the_cache_stores_nothing(store: CpuKVStore, cache: str) -> None:
    kv = _storage(cache, 8)
    view = kv.layer(0)
    k, v = (_rows(2, 8, torch.float32, seed) for seed in (5, 6))
    before = _stored(kv)
    for bad in (kv.num_slots, -1):
        with pytest.raises(ValueError, match=f"outside the cache's {kv.num_slots} slots"):
            store(view.k, view.v, view.k_scale, view.v_scale, torch.tensor([1, bad]), k, v, view.encoding.name)
        with pytest.raises(ValueError, match="outside the cache"):
            kv.write(0, torch.tensor([1, bad]), k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, _stored(kv)))


def test_what_the_store_does_not_take_goes_to_torch() -> None:
    kv = _storage("int8", 8)
    view = kv.layer(0)
    k = _rows(2, 8, torch.float32, 7)
    assert not CpuKVStore.takes(view.k, view.k_scale, k.bfloat16(), k.bfloat16(), "int8")  # quantizes fp32 only
    transposed = k.transpose(1, 2).contiguous().transpose(1, 2)  # heads not contiguous in a token's row
    assert not CpuKVStore.takes(view.k, view.k_scale, transposed, transposed, "int8")
    kv.write(0, torch.tensor([0, 1]), transposed, transposed)  # the torch path stores it
    assert torch.allclose(kv.layer(0).gather(torch.tensor([0, 1]))[0], k, atol=0.05)


@pytest.mark.parametrize("cache", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("where", [0, 3])  # a group's first value, and one after it
def test_a_nan_gives_its_group_nan_parameters_as_the_twin_does(store: CpuKVStore, cache: str, where: int) -> None:
    """A NaN (a broken model's) reads back as NaN, never as a made-up finite value kept in a cached block: int4
    once took the group's minimum for a NaN that was not the group's first value."""
    by_store, by_torch = _storage(cache, 64), _storage(cache, 64)
    k, v = (_rows(2, 64, torch.float32, seed) for seed in (7, 8))
    v[1, 2, where] = float("nan")
    slots = torch.tensor([5, 9])
    view = by_store.layer(0)
    store(view.k, view.v, view.k_scale, view.v_scale, slots, k, v, cache)
    by_torch.write_by_torch(by_torch.layer(0), slots, k, v)
    ours, twin = (kv.layer(0).v_scale.float().isnan() for kv in (by_store, by_torch))
    assert ours.any() and torch.equal(ours, twin)
    assert by_store.layer(0).gather(slots)[1][1, 2, where].isnan()
