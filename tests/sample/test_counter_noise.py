"""Counter-based noise for seeded draws: the int64 tensor hash is splitmix64's finaliser bit for bit, a row's
noise depends on its key alone (not on the batch, nor on how the CPU path chunks the rows), and it is Exp(1)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve.sample import counter_noise
from kvserve.sample.counter_noise import draw_seed, mix64, mix64_tensor, seeded_exponentials

CPU = torch.device("cpu")


def test_the_tensor_hash_is_the_integer_finaliser_bit_for_bit() -> None:
    rng = random.Random(0)
    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, *(rng.getrandbits(64) for _ in range(10_000))]
    signed = torch.tensor([v - 2**64 if v >= 2**63 else v for v in values], dtype=torch.int64)
    hashed = [v % 2**64 for v in mix64_tensor(signed).tolist()]
    assert hashed == [mix64(v) for v in values]


def test_mix64_is_splitmix64s_finaliser() -> None:
    # splitmix64 seeded with 0: its first output is mix64(0x9E3779B97F4A7C15), a published value
    assert mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_each_value_is_the_hash_of_its_key_and_token() -> None:
    keys = [draw_seed(7, 0, 3), 2**64 - 1, 0]
    noise = seeded_exponentials(keys, 11, CPU)
    for r, key in enumerate(keys):
        for t in range(11):
            bits = mix64((key + t * 0x9E3779B97F4A7C15) % 2**64) >> 41
            expected = -math.log((bits + 0.5) / 2**23)  # the uniform is exact; float32's log within 1 ulp
            assert noise[r, t].item() == pytest.approx(expected, rel=2**-22)


def test_a_rows_noise_depends_on_its_key_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(9)]
    together = seeded_exponentials(keys, 1000, CPU)
    for r, key in enumerate(keys):
        assert torch.equal(seeded_exponentials([key], 1000, CPU)[0], together[r])
    monkeypatch.setattr(counter_noise, "_CPU_CHUNK_ELEMENTS", 3000)  # three rows a chunk, the last one short
    assert torch.equal(seeded_exponentials(keys, 1000, CPU), together)
    assert seeded_exponentials([], 1000, CPU).shape == (0, 1000)


def test_the_noise_is_exp1_and_rows_are_uncorrelated() -> None:
    noise = seeded_exponentials([draw_seed(s, 0, 0) for s in range(8)], 50_000, CPU).double()
    assert noise.min() > 0 and noise.max() <= -math.log(0.5 / 2**23) + 1e-3
    assert abs(noise.mean().item() - 1) < 0.01  # standard error 1 / sqrt(400,000) = 0.0016
    assert abs(noise.var().item() - 1) < 0.03
    for x in (0.1, 1.0, 3.0):  # the distribution function 1 - exp(-x), within 5 standard errors
        assert abs((noise <= x).double().mean().item() - (1 - math.exp(-x))) < 5 * 0.5 / math.sqrt(noise.numel())
    correlation = torch.corrcoef(noise)
    assert (correlation - torch.eye(8, dtype=torch.float64)).abs().max() < 0.03
    consecutive = torch.corrcoef(torch.stack([noise[0, :-1], noise[0, 1:]]))[0, 1]
    assert abs(consecutive) < 0.03  # neighbouring tokens of one row


def test_nearby_seeds_indices_and_positions_give_distinct_keys() -> None:
    keys = {draw_seed(s, i, p) for s in range(8) for i in range(4) for p in range(16)}
    assert len(keys) == 8 * 4 * 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_key_gives_the_same_noise_on_cuda_as_on_cpu() -> None:
    keys = [draw_seed(s, i, p) for s in range(3) for i in range(2) for p in (0, 9)]
    on_cpu = seeded_exponentials(keys, 262_144, CPU)
    on_cuda = seeded_exponentials(keys, 262_144, torch.device("cuda")).cpu()
    torch.testing.assert_close(on_cuda, on_cpu, rtol=2**-22, atol=0)  # the integers are exact; the log's last bit


def test_seeds_that_share_their_low_58_bits_draw_apart() -> None:
    """The key was built from seed * MAX_N (64) mod 2^64: seeds 1 and 2^58 + 1 drew the same text."""
    assert draw_seed(1, 0, 0) != draw_seed(2**58 + 1, 0, 0)
    assert len({draw_seed(s, i, 0) for s in (5, 5 + 2**58, 5 - 2**58, -5) for i in range(64)}) == 4 * 64
