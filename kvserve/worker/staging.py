"""PinnedStaging: a step's host-built input arrays sent to the device in one copy.

Every array of a step (token ids, positions, slots, block tables, sequence lengths, the rows sampling reads)
is written into one persistent host buffer, each at an aligned offset, and the used prefix goes to one
persistent device buffer in one non-blocking copy; the step's device tensors are views of that buffer::

    host (pinned on CUDA):  | input_ids | positions | slot_mapping | block_tables | ... |
                                          one cudaMemcpyAsync
    device:                 | input_ids | positions | slot_mapping | block_tables | ... |   views, by dtype

At one stream a step is a chain of short device operations, each costing a launch, and its host work is on
the device's critical path: seven copies (each a host-side cast, a pinned copy and a transfer) cost more than
packing seven small arrays with numpy. Both buffers are reused step after step. The device buffer is
overwritten in stream order, after the kernels queued before have read it. The host buffer is written only
once the last copy out of it has run (an event; by then the step's sampled-token read has normally waited
for it already, but the draft model's first pass may be followed by the target's step without one).
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN_BYTES = 16  # each array's offset: any dtype's view of the buffer is aligned, and copies stay vectorised
MIN_BUFFER_BYTES = 64 << 10


class PinnedStaging:
    """Packs named host arrays into one buffer and returns their device views (``send``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host = torch.empty(0, dtype=torch.uint8)
        self._device = torch.empty(0, dtype=torch.uint8, device=device)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copy out of _host

    def send(self, arrays: dict[str, tuple[np.ndarray, torch.dtype]]) -> dict[str, torch.Tensor]:
        """Each ``name: (array, dtype)`` as a tensor of that dtype and the array's shape on the device, all
        through one host-to-device copy."""
        spans, num_bytes = {}, 0  # name -> (first byte, bytes)
        for name, (array, dtype) in arrays.items():
            spans[name] = (num_bytes, array.size * dtype.itemsize)
            num_bytes += -(-spans[name][1] // ALIGN_BYTES) * ALIGN_BYTES
        if self._copied is not None:
            self._copied.synchronize()  # a no-op unless a copy is still queued (after a draft pass)
        host, device = self._buffers(num_bytes)
        packed = host.numpy()
        for name, (array, dtype) in arrays.items():
            start, size = spans[name]
            packed[start:start + size].view(_NUMPY_DTYPES[dtype])[:] = array.reshape(-1)  # numpy casts as it copies
        device[:num_bytes].copy_(host[:num_bytes], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return {name: device[start:start + size].view(dtype).view(array.shape)
                for (name, (array, dtype)), (start, size) in zip(arrays.items(), spans.values())}

    def _buffers(self, num_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host.numel() < num_bytes:
            size = max(MIN_BUFFER_BYTES, 2 * num_bytes)
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._device = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._host, self._device


_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}
