"""PinnedStaging: a step's host arrays as device tensors of their dtypes and shapes, all views of one buffer
filled by one copy (on CPU here; on CUDA the host side is pinned and the copy non-blocking)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.worker.staging import ALIGN_BYTES, MIN_BUFFER_BYTES, PinnedStaging

CPU = torch.device("cpu")


def step_arrays(rng: np.random.Generator, num_tokens: int) -> dict[str, tuple[np.ndarray, torch.dtype]]:
    return {
        "input_ids": (rng.integers(0, 128_256, num_tokens), torch.int64),
        "query_start_loc": (np.arange(num_tokens + 1), torch.int32),  # int64 on the host, int32 on the device
        "block_tables0": (rng.integers(0, 10_000, (num_tokens, 7)).astype(np.int32), torch.int32),
        "slot_mapping0": (rng.integers(0, 160_000, num_tokens), torch.int64),
        "empty": (np.zeros(0, dtype=np.int64), torch.int64),
    }


def test_every_array_arrives_with_its_dtype_and_shape_in_one_buffer() -> None:
    staging, rng = PinnedStaging(CPU), np.random.default_rng(0)
    for num_tokens in (1, 3, 64, 5000):  # 5000 tokens outgrow the first buffer
        arrays = step_arrays(rng, num_tokens)
        sent = staging.send(arrays)
        assert sent.keys() == arrays.keys()
        for name, (array, dtype) in arrays.items():
            assert sent[name].dtype == dtype and tuple(sent[name].shape) == array.shape
            assert np.array_equal(sent[name].numpy(), array.astype(sent[name].numpy().dtype))
        storages = {t.untyped_storage().data_ptr() for t in sent.values()}
        assert len(storages) == 1  # one buffer, so one host-to-device copy
        assert all(t.storage_offset() * t.element_size() % ALIGN_BYTES == 0 for t in sent.values())


def test_the_buffers_are_reused_until_a_step_outgrows_them() -> None:
    staging, rng = PinnedStaging(CPU), np.random.default_rng(1)
    first = staging.send(step_arrays(rng, 8))["input_ids"]
    second = staging.send(step_arrays(rng, 9))["input_ids"]
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    grown = staging.send({"big": (np.arange(MIN_BUFFER_BYTES), torch.int64)})["big"]
    assert grown.untyped_storage().nbytes() >= MIN_BUFFER_BYTES * 8
    assert np.array_equal(grown.numpy(), np.arange(MIN_BUFFER_BYTES))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_step_is_one_pinned_copy_whose_buffer_waits_for_it() -> None:
    cuda, rng = torch.device("cuda"), np.random.default_rng(2)
    staging = PinnedStaging(cuda)
    arrays = step_arrays(rng, 300)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        sent = staging.send(arrays)
        torch.cuda.synchronize()
    copies = [e for e in profiler.events() if "Memcpy HtoD" in e.name]
    assert len(copies) == 1 and "Pinned" in copies[0].name
    for name, (array, dtype) in arrays.items():
        assert sent[name].device.type == "cuda" and sent[name].dtype == dtype
        assert np.array_equal(sent[name].cpu().numpy(), array.astype(sent[name].cpu().numpy().dtype))
    torch.cuda._sleep(1_000_000_000)  # the device busy: the next send's copy queues behind it
    queued = step_arrays(rng, 300)
    seen = staging.send(queued)["slot_mapping0"].clone()  # what that copy delivers, read in stream order
    staging.send(step_arrays(rng, 300))  # must not repack the host buffer before the queued copy has read it
    assert np.array_equal(seen.cpu().numpy(), queued["slot_mapping0"][0])
