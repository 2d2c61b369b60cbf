"""to_device: host data on a device in the dtype asked for, and on CUDA without waiting for queued work;
HostCopy: a device result read back without waiting for work queued after it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.device_copy import HostCopy, to_device


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


def test_a_host_copy_on_cpu_is_the_tensor_itself() -> None:
    tensor = torch.arange(5)
    assert HostCopy(tensor).result() is tensor


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_host_copy_does_not_wait_for_work_queued_after_it() -> None:
    torch.cuda.synchronize()
    sampled = torch.tensor([4, 5, 6], device="cuda")
    copy = HostCopy(sampled)
    torch.cuda._sleep(2_000_000_000)  # the next step, queued behind the copy
    slept = torch.cuda.Event()
    slept.record()
    assert copy.result().tolist() == [4, 5, 6]
    assert not slept.query()  # read back while the device still runs what came after
