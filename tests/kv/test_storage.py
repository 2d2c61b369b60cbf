"""KVCacheStorage: writes read back through the layer views, block copies, sizing, and refused writes."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.quant import ENCODINGS
from kvserve.kv.storage import KVCacheDtype, KVCacheSpec, KVCacheStorage, zeros

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 3, 2, 8, 4, 6


def make_storage(dtype: torch.dtype = torch.float32) -> KVCacheStorage:
    return KVCacheStorage(KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype), NUM_BLOCKS, "cpu")


def random_kv(num_tokens: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in "kv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_writes_read_back_through_every_layer_view(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv = make_storage(dtype)
    written = {}
    for layer in range(NUM_LAYERS):
        slots = torch.randperm(kv.num_slots, generator=gen)[: 1 + seed * 5]
        k, v = random_kv(slots.numel(), dtype, gen)
        kv.write(layer, slots, k, v)
        written[layer] = slots, k, v
    for layer, (slots, k, v) in written.items():  # later layers' writes left earlier layers alone
        view = kv.layer(layer)
        keys, values = view.gather(slots)
        assert keys.dtype == dtype and torch.equal(keys, k) and torch.equal(values, v)
        assert view.k_scale is None and view.v_scale is None
        unwritten = torch.ones(kv.num_slots, dtype=torch.bool)
        unwritten[slots] = False
        assert not view.gather(unwritten.nonzero().flatten())[0].any()


def test_gather_rows_orders_rows_as_slot_times_heads_plus_head() -> None:
    kv = make_storage()
    k, v = random_kv(2, torch.float32, torch.Generator().manual_seed(0))
    kv.write(1, torch.tensor([9, 2]), k, v)
    rows = torch.tensor([2 * NUM_KV_HEADS + 1, 9 * NUM_KV_HEADS, 2 * NUM_KV_HEADS])
    keys, values = kv.layer(1).gather_rows(rows, torch.empty(2, 3, HEAD_DIM))
    assert torch.equal(keys, torch.stack([k[1, 1], k[0, 0], k[1, 0]]))
    assert torch.equal(values, torch.stack([v[1, 1], v[0, 0], v[1, 0]]))


def test_copy_blocks_copies_every_layer_and_leaves_the_source() -> None:
    gen = torch.Generator().manual_seed(1)
    kv = make_storage()
    src_slots = torch.arange(2 * BLOCK_SIZE, 3 * BLOCK_SIZE)  # block 2
    for layer in range(NUM_LAYERS):
        kv.write(layer, src_slots, *random_kv(BLOCK_SIZE, torch.float32, gen))
    before = [kv.layer(layer).gather(src_slots) for layer in range(NUM_LAYERS)]
    kv.copy_blocks(((2, 5), (2, 0)))
    for layer, (k, v) in enumerate(before):
        for block in (0, 2, 5):
            keys, values = kv.layer(layer).gather(torch.arange(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE))
            assert torch.equal(keys, k) and torch.equal(values, v)
        assert not kv.layer(layer).k[1].any()
    kv.copy_blocks(())


@pytest.mark.parametrize("dtype, element_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_bytes_per_block_counts_k_and_v_of_every_layer(dtype: torch.dtype, element_bytes: int) -> None:
    kv = make_storage(dtype)
    assert kv.spec.kv_dtype == KVCacheDtype.unquantized(dtype) and not kv.spec.kv_dtype.has_scales
    assert kv.spec.bytes_per_block == 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * element_bytes
    assert kv.nbytes == kv.spec.bytes_per_block * NUM_BLOCKS
    assert kv.nbytes == sum(t.nbytes for layer in range(NUM_LAYERS) for t in kv.layer(layer).tensors())


def test_bytes_per_block_of_a_quantized_encoding_counts_its_scales() -> None:
    int8 = KVCacheDtype("int8", torch.int8, scale_dtype=torch.float32)
    int4 = KVCacheDtype("int4", torch.uint8, scale_dtype=torch.float16, values_per_element=2)
    assert int8.has_scales and int4.has_scales
    per_block = 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS
    spec = KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, cache_dtype=int8)
    assert spec.kv_dtype.name == "int8" and spec.bytes_per_block == per_block * (HEAD_DIM * 1 + 4)
    spec = KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, cache_dtype=int4)
    assert spec.bytes_per_block == per_block * (HEAD_DIM // 2 + 2)
    for name, row_bytes in (("int8", HEAD_DIM + 2), ("fp8", HEAD_DIM + 2), ("int4", HEAD_DIM // 2 + 2 * 2)):
        spec = KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, ENCODINGS[name])
        kv = KVCacheStorage(spec, NUM_BLOCKS, "cpu")
        assert spec.bytes_per_block == per_block * row_bytes
        assert kv.nbytes == sum(t.nbytes for layer in range(NUM_LAYERS) for t in kv.layer(layer).tensors())


def test_specs_that_cannot_be_stored_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        KVCacheSpec(NUM_LAYERS, 0, HEAD_DIM, BLOCK_SIZE, torch.float32)
    with pytest.raises(ValueError, match="does not pack"):
        KVCacheSpec(1, 1, 7, 1, torch.float32, KVCacheDtype("int4", torch.uint8, torch.float16, 2))
    with pytest.raises(ValueError, match="only float data may be stored without scales"):
        KVCacheDtype("int8", torch.int8)
    with pytest.raises(ValueError, match="max_group must be 0 or a power of two, got 48"):
        KVCacheDtype("int4", torch.uint8, torch.float16, 2, True, max_group=48)
    with pytest.raises(ValueError, match="num_blocks=0"):
        KVCacheStorage(KVCacheSpec(1, 1, 1, 1, torch.float32), 0, "cpu")


def test_writes_of_the_wrong_shape_or_dtype_are_refused() -> None:
    kv = make_storage()
    slots = torch.tensor([0, 5, 7])
    k, v = random_kv(3, torch.float32, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"must be \(3, 2, 8\)"):
        kv.write(0, slots, k[:2], v[:2])
    with pytest.raises(ValueError, match=r"must be \(3, 2, 8\)"):
        kv.write(0, slots, k[:, :1], v)
    with pytest.raises(ValueError, match=r"must be \(3, 2, 8\)"):
        kv.write(0, slots, k, v[..., :4])
    with pytest.raises(TypeError, match="model's torch.float32"):
        kv.write(0, slots, k.bfloat16(), v)
    with pytest.raises(TypeError, match="int64 slots"):
        kv.write(0, slots.int(), k, v)
    with pytest.raises(IndexError, match="outside the cache's 3 layers"):
        kv.write(NUM_LAYERS, slots, k, v)
    assert not any(kv.layer(layer).k.any() or kv.layer(layer).v.any() for layer in range(NUM_LAYERS))


@pytest.mark.parametrize("bad_slot", [NUM_BLOCKS * BLOCK_SIZE, -1])
def test_a_slot_outside_the_cache_is_refused(bad_slot: int) -> None:
    kv = make_storage()
    k, v = random_kv(2, torch.float32, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=f"outside the cache's {NUM_BLOCKS * BLOCK_SIZE} slots"):
        kv.write(0, torch.tensor([3, bad_slot]), k, v)


@pytest.mark.parametrize("encoding", [None, *ENCODINGS])
@pytest.mark.parametrize("shape", [(NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE), (1, 2, 1)])  # (1, 2, 1): 1- to 4-byte parts
def test_blocks_read_out_and_written_back_are_bit_exact(encoding: str | None, shape: tuple[int, int, int]) -> None:
    """What the KV tiers keep: whole blocks as stored, data and scales, moved out to rows and back."""
    num_kv_heads, head_dim, block_size = shape
    spec = KVCacheSpec(NUM_LAYERS, num_kv_heads, head_dim, block_size, torch.float32,
                       ENCODINGS[encoding] if encoding else None)
    source, target = (KVCacheStorage(spec, NUM_BLOCKS, "cpu") for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    for layer in range(NUM_LAYERS):
        k, v = (torch.randn(source.num_slots, num_kv_heads, head_dim, generator=gen) for _ in "kv")
        source.write(layer, torch.arange(source.num_slots), k, v)
    rows = torch.zeros(5, spec.bytes_per_block, dtype=torch.uint8)
    source.read_blocks([4, 1], rows, [3, 0])
    target.write_blocks([0, 5], rows, [3, 0])  # block 4 -> row 3 -> block 0; block 1 -> row 0 -> block 5
    for layer in range(NUM_LAYERS):
        for src, dst in zip(source.layer(layer).tensors(), target.layer(layer).tensors()):
            assert torch.equal(src[4].view(torch.uint8), dst[0].view(torch.uint8))
            assert torch.equal(src[1].view(torch.uint8), dst[5].view(torch.uint8))
            assert not dst[1:5].view(torch.uint8).any()  # nothing else written


def test_block_rows_of_the_wrong_shape_are_refused() -> None:
    kv = make_storage()
    with pytest.raises(ValueError, match="uint8"):
        kv.read_blocks([0], torch.zeros(1, kv.spec.bytes_per_block - 1, dtype=torch.uint8), [0])
    with pytest.raises(ValueError, match="2 blocks but 1 rows"):
        kv.write_blocks([0, 1], torch.zeros(1, kv.spec.bytes_per_block, dtype=torch.uint8), [0])


@pytest.mark.parametrize("encoding", [None, *ENCODINGS])
def test_a_new_cpu_pool_is_zeros_in_memory_the_os_maps_on_first_touch(encoding: str | None) -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32,
                       cache_dtype=ENCODINGS[encoding] if encoding else None)
    storage = KVCacheStorage(spec, num_blocks=512, device="cpu")
    for view in (storage.layer(0), storage.layer(1)):
        for tensor in view.tensors():
            assert not tensor.view(torch.uint8).any()
            assert tensor.untyped_storage().nbytes() == tensor.nbytes  # a mapping of its own, not a shared slab
    mapped = zeros((1 << 20,), torch.float32, "cpu")  # 4 MiB: resident only as it is touched
    before = _resident_kib(mapped)
    mapped[:1024] = 1.0
    assert before == 0 and 0 < _resident_kib(mapped) < 1024 and mapped.sum().item() == 1024


def _resident_kib(tensor: torch.Tensor) -> int:
    """The resident size of the mapping holding ``tensor`` (its /proc/self/smaps entry)."""
    start = tensor.data_ptr()
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for index, line in enumerate(lines):
        low = line.split(" ", 1)[0].split("-")
        if len(low) == 2 and all(c in "0123456789abcdef" for c in low[0] + low[1]) and \
                int(low[0], 16) <= start < int(low[1], 16):
            rss = next(entry for entry in lines[index + 1:] if entry.startswith("Rss:"))
            return int(rss.split()[1])
    raise AssertionError(f"no mapping holds address {start:#x}")
