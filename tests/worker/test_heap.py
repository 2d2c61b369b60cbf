"""Large CPU tensors: their pages reused from the heap, step after step."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from kvserve.worker.heap import keep_large_blocks


def _page_faults_of_a_fresh_logits_matrix() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(256, 49_152).fill_(1.0)  # 48 MiB, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_a_large_tensor_made_again_touches_no_new_pages() -> None:
    """glibc's own thresholds mapped each 48 MiB tensor anew: 12,288 page faults every time."""
    assert keep_large_blocks()
    faults = [_page_faults_of_a_fresh_logits_matrix() for _ in range(12)]  # the first ones grow the heap
    assert max(faults[-4:]) < 1_000, faults
