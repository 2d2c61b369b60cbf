"""to_device: host data on a device in the dtype asked for, and on CUDA without waiting for queued work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.device_copy import to_device


def test_lists_arrays_and_tensors_arrive_in_the_dtype_asked_for() -> None:
    cpu = torch.device("cpu")
    assert to_device([1, 2, 3], torch.long, cpu).tolist() == [1, 2, 3]
    assert to_device([0.5, 1.25], torch.bfloat16, cpu).dtype == torch.bfloat16
    array = np.arange(4, dtype=np.int64)
    assert torch.equal(to_device(array, torch.int32, cpu), torch.arange(4, dtype=torch.int32))
    assert to_device(torch.ones(2, 3, dtype=torch.int32), torch.int32, cpu).shape == (2, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_copy_onto_cuda_does_not_wait_for_queued_work() -> None:
    cuda = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of one GPU thread spinning, queued before the copy
    slept = torch.cuda.Event()
    slept.record()
    copied = to_device([7, 8, 9], torch.long, cuda)
    assert not slept.query()  # the host is here while the device still sleeps
    assert copied.tolist() == [7, 8, 9]
