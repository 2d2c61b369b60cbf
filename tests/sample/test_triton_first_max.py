"""The CUDA path's first max (``triton_first_max``), through Triton's interpreter without a GPU: torch's argmax on
ties, NaNs and infinities in any lane and tile, on rows past one tile, in each model dtype; shapes it does not
take are refused by name; ``-m gpu`` at Llama-3's and Gemma 3's vocabularies, through ``first_max``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA

from kvserve.sample.argmax import first_max  # noqa: E402
from kvserve.sample.triton_first_max import triton_first_max  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VALUES = [-math.inf, -1.0, 0.0, 2.0, 2.0, math.inf, math.nan]


SMALL = 16  # tiles of 16 values: rows of a few dozen cross several, as a vocabulary crosses 2,048-value ones


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from(VALUES), min_size=1, max_size=50), min_size=1, max_size=4)
       .filter(lambda r: len({len(x) for x in r}) == 1))
def test_first_max_is_argmax_ties_and_nans_included(rows: list[list[float]]) -> None:
    x = torch.tensor(rows)
    assert torch.equal(triton_first_max(x.to(DEVICE), SMALL).cpu(), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 3000])  # 3,000: more tiles than parts, 2 tiles a part
def test_rows_of_every_length_and_dtype_give_argmax(dtype: torch.dtype, n: int) -> None:
    """A value repeated across tiles and parts: its first place wins; bf16 rounds many values equal."""
    x = torch.randn(3, 2, n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[0, 1, n // 2 :] = x[0, 1].max() + 1  # ties from the middle on
    x[2, 0, n - 1] = math.nan  # a NaN in the last part
    assert torch.equal(triton_first_max(x.to(DEVICE), SMALL).cpu(), x.float().argmax(dim=-1))


def test_strided_rows_and_a_row_of_minus_infinity() -> None:
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))[:, 3:37]
    x[2] = -math.inf
    assert torch.equal(triton_first_max(x.to(DEVICE), SMALL).cpu(), x.argmax(dim=-1))
    assert triton_first_max(torch.empty(0, 5, device=DEVICE)).shape == (0,)


def test_what_it_does_not_take_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="float tensor"):
        triton_first_max(torch.ones(2, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        triton_first_max(torch.ones(3, 2, device=DEVICE).T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="first_max sends CUDA rows to the kernel")
@pytest.mark.parametrize("vocab", [128_256, 262_144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vocabularies_on_cuda_give_argmax(vocab: int, dtype: torch.dtype) -> None:
    x = torch.randn(64, vocab, device="cuda").to(dtype)
    x[5, 1000:] = x[5].max()
    x[7, vocab - 1] = math.nan
    assert torch.equal(first_max(x), x.argmax(dim=-1))
