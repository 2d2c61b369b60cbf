"""Fixtures the attention kernels' tests share."""

from __future__ import annotations

import pytest

from kvserve.attention import cpu_paged
from kvserve.attention.cpu_paged import CpuPagedBackend
from tests.isa_builds import isa_build


@pytest.fixture(scope="module", params=["native", "avx2"])
def isa_backend(request: pytest.FixtureRequest) -> CpuPagedBackend:
    """The C kernels as this CPU builds them, then their AVX2 build (on an AVX-512 CPU: the other code path)."""
    return CpuPagedBackend(tuple(isa_build(source, request.param)
                                 for source in (cpu_paged.DECODE_SOURCE, cpu_paged.PREFILL_SOURCE)))
