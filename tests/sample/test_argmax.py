"""first_max: each row's first maximum, NaN the largest, as torch.argmax, by the C kernel (the machine's build and
the AVX2 one) and by its plain-PyTorch twin; rows long enough to be split among threads merge their parts in
order."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sample.argmax import FIRST_MAX_SOURCE, bind, first_max, kernel_first_max, reference_first_max
from tests.isa_builds import isa_build

LONG = 100_003  # past two of the kernel's smallest parts (32,768 values): split among 2 or more threads
VALUES = [-math.inf, -1.0, 0.0, 2.0, 2.0, math.inf, math.nan]


@pytest.fixture(scope="module", params=["native", "avx2"])
def library(request: pytest.FixtureRequest) -> ctypes.CDLL:
    return bind(isa_build(FIRST_MAX_SOURCE, request.param))


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from(VALUES), min_size=1, max_size=40), min_size=1, max_size=6)
       .filter(lambda r: len({len(x) for x in r}) == 1))
def test_first_max_is_argmax_ties_and_nans_included(rows: list[list[float]]) -> None:
    x = torch.tensor(rows)
    assert torch.equal(first_max(x), x.argmax(dim=-1))
    assert torch.equal(reference_first_max(x), x.argmax(dim=-1))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 255, LONG])
def test_kernel_is_argmax_on_odd_lengths(library: ctypes.CDLL, n: int, threads: int) -> None:
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=generator)
    x[1] = x[1].round()  # many ties
    x[2] = -math.inf
    x[3, n // 2 :] = math.nan  # the first NaN wins
    x[4, -1] = 50.0  # the maximum last
    with _threads(threads):
        assert torch.equal(kernel_first_max(x, library), x.argmax(dim=-1))


@pytest.mark.parametrize("threads", [2, 3])
def test_a_split_row_merges_its_parts_in_order(library: ctypes.CDLL, threads: int) -> None:
    cases = {  # the positions to set, and to what: a tie across parts, a NaN or the maximum in a later part
        "tie across parts": [(10, 9.0), (LONG - 10, 9.0)],
        "later part larger": [(10, 9.0), (LONG - 10, 9.5)],
        "NaN in a later part": [(10, 9.0), (LONG - 10, math.nan), (LONG - 5, math.nan)],
        "NaN first, larger later": [(10, math.nan), (LONG - 10, math.inf)],
        "all -inf but a later -1": [(LONG - 3, -1.0)],
    }
    for name, marks in cases.items():
        x = torch.zeros(1, LONG) if name != "all -inf but a later -1" else torch.full((1, LONG), -math.inf)
        for position, value in marks:
            x[0, position] = value
        with _threads(threads):
            assert torch.equal(kernel_first_max(x, library), x.argmax(dim=-1)), name


def test_strided_rows_and_leading_dimensions(library: ctypes.CDLL) -> None:
    wide = torch.randn(4, 3, 70, generator=torch.Generator().manual_seed(1))
    x = wide[..., 5:61]  # rows 70 values apart, each 56 long
    assert torch.equal(kernel_first_max(x, library), x.argmax(dim=-1))
    assert kernel_first_max(x, library).shape == (4, 3)
    assert torch.equal(kernel_first_max(torch.empty(0, 9), library), torch.empty(0, dtype=torch.int64))


def test_what_the_kernel_does_not_take_goes_to_the_twin() -> None:
    for x in (torch.randn(3, 40).double(), torch.randn(3, 40).to(torch.bfloat16), torch.randn(40, 3).t()):
        assert torch.equal(first_max(x), x.argmax(dim=-1))


class _threads:
    def __init__(self, count: int) -> None:
        self.count, self.before = count, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.count)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)
