"""KV quantization: round-trip error bounds per encoding (int4 group by group, its keys rotated), and a quantized
KVCacheStorage (write, gather, copies)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve.config import KV_CACHE_DTYPES, CacheConfig
from kvserve.kv.quant import ENCODINGS, dequantize, hadamard, kv_cache_dtype, quantize, rotate_queries
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage


def round_trip(x: torch.Tensor, name: str, keys: bool = False) -> torch.Tensor:
    encoding = ENCODINGS[name]
    data, params = quantize(x, encoding, keys)
    assert data.dtype == encoding.data_dtype and params.dtype == encoding.scale_dtype
    assert data.shape == (*x.shape[:-1], x.shape[-1] // encoding.values_per_element)
    assert params.shape == (*x.shape[:-1], encoding.params_per_row(x.shape[-1]))
    return dequantize(data, params, encoding, x.dtype, keys)


def error_bound(x: torch.Tensor, name: str) -> torch.Tensor:
    """The most each value may move: half a step of its group's grid (fp8: half a step of 3 mantissa bits,
    relative, or of the subnormal grid), the grid's scale being fp16's (rounded up: relatively 2^-10, or fp16's
    subnormal step 2^-24); plus the fp16 rounding of int4's zero point and scale."""
    groups = x.unflatten(-1, (-1, ENCODINGS[name].group_size(x.shape[-1])))
    return _group_bound(groups, name).expand(groups.shape).flatten(-2)


def _group_bound(x: torch.Tensor, name: str) -> torch.Tensor:
    amax = x.abs().amax(-1, keepdim=True)
    if name in ("int8", "fp8"):
        limit = 127 if name == "int8" else 448
        stored_scale = amax / limit * (1 + 2**-10) + 2**-24
        if name == "int8":
            return stored_scale / 2 * (1 + 1e-5)
        return torch.maximum(x.abs() * 2**-4, stored_scale * 2**-10) * (1 + 1e-5)
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 15
    # fp16's relative rounding of s and z; and where they fall on its subnormal grid (steps of 2^-24: a group's
    # range can be that small once groups are a few values), up to 2^-25 each, s counting up to 15 times
    return step / 2 * (1 + 2**-9) + amax * 2**-10 + 16 * 2**-25


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(list(ENCODINGS)),
    rows=st.integers(1, 7),
    heads=st.integers(1, 3),
    half_dim=st.integers(1, 70),
    magnitude=st.sampled_from([1e-3, 1.0, 30.0, 1000.0]),
    seed=st.integers(0, 2**16),
)
@example(name="int8", rows=1, heads=3, half_dim=1, magnitude=1e-3, seed=65535)  # subnormal fp16 scales
def test_round_trip_error_is_within_half_a_step(name: str, rows: int, heads: int, half_dim: int, magnitude: float,
                                               seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, 2 * half_dim, generator=gen) * magnitude
    x[0, 0, 0] += 5 * magnitude  # an outlier, as keys have
    error = (round_trip(x, name) - x).abs()
    assert (error <= error_bound(x, name)).all(), (error - error_bound(x, name)).max()


@settings(max_examples=40, deadline=None)
@given(log_dim=st.integers(1, 8), rows=st.integers(1, 5), magnitude=st.sampled_from([1e-3, 1.0, 1000.0]),
       seed=st.integers(0, 2**16))
def test_int4_keys_come_back_within_the_rotated_groups_half_steps(log_dim: int, rows: int, magnitude: float,
                                                                   seed: int) -> None:
    """Keys are quantized rotated and rotated back: the rotation is orthogonal, so each group's error is as
    long (L2) as it was in the rotated basis, where each value moved by at most half a step."""
    head_dim = 2**log_dim
    group = ENCODINGS["int4"].group_size(head_dim)
    assert group == min(head_dim, 64)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2, head_dim, generator=gen) * magnitude
    x[..., 0] *= 20  # an outlier channel, as keys have
    error = (round_trip(x, "int4", keys=True) - x).unflatten(-1, (-1, group)).norm(dim=-1)
    rotated_bound = error_bound(hadamard(x, group), "int4").unflatten(-1, (-1, group)).norm(dim=-1)
    assert (error <= rotated_bound * (1 + 1e-4) + 1e-6 * magnitude).all()


def test_int4_groups_take_the_largest_power_of_two_dividing_head_dim_up_to_64() -> None:
    int4 = ENCODINGS["int4"]
    assert [int4.group_size(d) for d in (2, 10, 16, 64, 80, 96, 128, 256)] == [2, 2, 16, 64, 16, 32, 64, 64]
    assert [int4.params_per_row(d) for d in (64, 96, 256)] == [2, 6, 8]
    assert ENCODINGS["int8"].group_size(256) == 256 and ENCODINGS["int8"].params_per_row(256) == 1


def test_the_hadamard_rotation_is_its_own_inverse_and_queries_rotate_as_keys_do() -> None:
    gen = torch.Generator().manual_seed(0)
    x, q = torch.randn(2, 4, 3, 256, generator=gen)
    assert torch.allclose(hadamard(hadamard(x, 64), 64), x, atol=1e-5)
    assert torch.allclose(hadamard(x, 64).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    rotated = rotate_queries(q, ENCODINGS["int4"])
    assert torch.allclose((rotated * hadamard(x, 64)).sum(-1), (q * x).sum(-1), atol=1e-4)
    assert rotate_queries(q, ENCODINGS["int8"]) is q
    # one outlier stretches a whole group's grid; rotated, it is spread over the group
    keys = torch.randn(64, 3, 64, generator=gen)
    keys[..., 5] *= 30
    plain = (round_trip(keys, "int4") - keys).norm()
    assert (round_trip(keys, "int4", keys=True) - keys).norm() < plain / 3


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_zero_rows_stay_zero_and_bf16_comes_back_as_bf16(name: str) -> None:
    x = torch.zeros(2, 3, 8)
    assert torch.equal(round_trip(x, name), x)
    y = torch.randn(4, 2, 16).bfloat16()
    assert round_trip(y, name).dtype == torch.bfloat16


def test_kv_cache_dtypes_are_the_encodings_and_bad_names_are_refused() -> None:
    assert KV_CACHE_DTYPES == ("auto", *ENCODINGS)
    assert kv_cache_dtype("auto", torch.bfloat16).name == "bfloat16"
    assert kv_cache_dtype("int4", torch.float32) is ENCODINGS["int4"]
    with pytest.raises(ValueError, match="kv_cache_dtype='int2' is not one of auto, int8, fp8, int4"):
        kv_cache_dtype("int2", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16' is not one of auto, int8, fp8, int4"):
        CacheConfig(kv_cache_dtype="fp16")


NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 2, 16, 4, 6


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_storage_writes_quantized_and_reads_back_dequantized(name: str) -> None:
    encoding = ENCODINGS[name]
    kv = KVCacheStorage(KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32, encoding),
                        NUM_BLOCKS, "cpu")
    view = kv.layer(1)
    assert view.k.dtype == encoding.data_dtype and view.k_scale.shape[-1] == encoding.params_per_row(HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([3, 9, 10, 0, 23])
    k, v = (torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=gen) for _ in "kv")
    kv.write(1, slots, k, v)
    keys, values = view.gather(slots)
    assert keys.dtype == torch.float32
    assert torch.equal(keys, round_trip(k, name, keys=True)) and torch.equal(values, round_trip(v, name))
    assert not kv.layer(0).k_scale.any()

    kv.copy_blocks(((2, 5),))  # slots 9 and 10 live in block 2: their codes and parameters both travel
    copied = view.gather(torch.tensor([21, 22]))
    assert torch.equal(copied[0], keys[1:3]) and torch.equal(copied[1], values[1:3])


def test_a_quantized_budget_holds_proportionally_more_blocks() -> None:
    """SmolLM2's shape (3 KV heads, head_dim 64): tokens per byte against fp32."""
    spec = KVCacheSpec(30, 3, 64, 16, torch.float32)
    ratios = {name: spec.bytes_per_block / KVCacheSpec(30, 3, 64, 16, torch.float32, e).bytes_per_block
              for name, e in ENCODINGS.items()}
    assert ratios == {"int8": 256 / 66, "fp8": 256 / 66, "int4": 256 / 36}  # 3.88x, 3.88x, 7.1x
    bf16 = KVCacheSpec(30, 3, 64, 16, torch.bfloat16)
    assert {name: bf16.bytes_per_block / KVCacheSpec(30, 3, 64, 16, torch.bfloat16, e).bytes_per_block
            for name, e in ENCODINGS.items()} == {"int8": 128 / 66, "fp8": 128 / 66, "int4": 128 / 36}  # 1.94x, 3.6x


def test_int4_keeps_3_5x_bf16s_tokens_at_gemma_3s_head_dim() -> None:
    """Gemma 3 270M's shape (1 KV head, head_dim 256): four groups of 64 a row, 144 bytes against bf16's 512."""
    bf16 = KVCacheSpec(18, 1, 256, 16, torch.bfloat16)
    int4 = KVCacheSpec(18, 1, 256, 16, torch.bfloat16, ENCODINGS["int4"])
    assert bf16.bytes_per_block / int4.bytes_per_block == 512 / 144 > 3.5
