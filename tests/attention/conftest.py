"""Fixtures the attention kernels' tests share."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import cpu_paged
from kvserve.attention.cpu_paged import CpuPagedBackend
from tests.isa_builds import isa_build


@pytest.fixture(scope="module", params=["native", "avx2"])
def isa_backend(request: pytest.FixtureRequest) -> CpuPagedBackend:
    """The C kernels as this CPU builds them, then their AVX2 build (on an AVX-512 CPU: the other code path)."""
    return CpuPagedBackend(tuple(isa_build(source, request.param)
                                 for source in (cpu_paged.DECODE_SOURCE, cpu_paged.PREFILL_SOURCE)))


@pytest.fixture(params=[1, 4, 16])
def num_threads(request: pytest.FixtureRequest):
    """The decode kernel's work items are whole sequences when there are at least 4 per thread, else single KV
    heads; the more threads, the more work items a sharing group's shared keys are cut into."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
