"""Counter-based Exp(1) noise for seeded draws: a seeded row's noise at token ``t`` is a pure function of its
key and ``t``, computed by integer hashing (splitmix64's finaliser) instead of drawn from a generator.

So every seeded row of a step draws in one batched computation, with no generator per row and no launch per
row on the device; a key gives the same integers on every device (only the final ``log`` may differ in its
last bit between CPU and CUDA); and a row's noise depends on nothing but its key, never on the other rows of
the batch.

    key(seed, sample index, position) = mix(mix(mix(seed) ^ index) ^ position)       host, Python ints
    noise[r, t] = -log((top 23 bits of mix(key[r] + t * GOLDEN) + 1/2) / 2^23)       device, int64 tensors

``mix`` is splitmix64's finaliser, a bijection of 64-bit integers whose outputs pass the usual tests of
randomness for consecutive inputs; with 23 bits the uniform (n + 1/2) / 2^23 is exact in float32, and the noise
lies in [6e-8, 16.6], never 0 (a zero would turn a masked token's 0 / 0 into NaN in the race).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvserve.device_copy import to_device

_MASK64 = (1 << 64) - 1
_MIX_SHIFTS_AND_MULTIPLIERS = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB))
_LAST_SHIFT = 31
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: consecutive token ids land far apart before mixing
_UNIFORM_BITS = 23
# On CPU the rows are hashed a few at a time so that the int64 temporaries stay in cache (2.6x faster for
# Gemma 3's 262,144-token vocabulary); a GPU takes the whole batch in one pass.
_CPU_CHUNK_ELEMENTS = 1 << 18


def draw_seed(seed: int, sample_index: int, position: int) -> int:
    """The key of a seeded sample's draw at output ``position``: for one seed, distinct for each sample of a
    request and each position; across seeds, alike only by a 64-bit hash's chance (``seed * MAX_N + index``, as
    before, lost the seed's top 6 bits, so seeds 2^58 apart drew alike); reproducible across runs and processes."""
    return mix64(mix64(mix64(seed) ^ sample_index) ^ position)


def mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (taken mod 2^64)."""
    x &= _MASK64
    for shift, multiplier in _MIX_SHIFTS_AND_MULTIPLIERS:
        x = ((x ^ (x >> shift)) * multiplier) & _MASK64
    return x ^ (x >> _LAST_SHIFT)


def seeded_exponentials(keys: Sequence[int], num_columns: int, device: torch.device) -> torch.Tensor:
    """[len(keys), num_columns] float32 Exp(1) noise, row ``r`` a function of ``keys[r]`` alone."""
    out = torch.empty(len(keys), num_columns, dtype=torch.float32, device=device)
    signed_keys = to_device([_signed(k) for k in keys], torch.int64, device)
    columns = torch.arange(num_columns, dtype=torch.int64, device=device).mul_(_signed(_GOLDEN))
    step = max(1, _CPU_CHUNK_ELEMENTS // max(num_columns, 1)) if device.type == "cpu" else max(len(keys), 1)
    for start in range(0, len(keys), step):
        hashed = mix64_tensor(signed_keys[start : start + step, None] + columns)
        uniform = _logical_shift(hashed, 64 - _UNIFORM_BITS).to(torch.float32)
        out[start : start + step] = uniform.add_(0.5).mul_(2.0**-_UNIFORM_BITS).log_().neg_()
    return out


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """``mix64`` on int64 tensors, in place: torch's int64 multiply wraps mod 2^64 as the finaliser needs, and
    its right shift is arithmetic, so each shift is masked to the logical one."""
    for shift, multiplier in _MIX_SHIFTS_AND_MULTIPLIERS:
        x ^= _logical_shift(x, shift)
        x *= _signed(multiplier)
    x ^= _logical_shift(x, _LAST_SHIFT)
    return x


def _logical_shift(x: torch.Tensor, shift: int) -> torch.Tensor:
    return (x >> shift).bitwise_and_((1 << (64 - shift)) - 1)


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as ``x`` (0 <= x < 2^64)."""
    return x - (1 << 64) if x >= 1 << 63 else x
