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
        offsets, num_bytes = {}, 0
        for name, (array, dtype) in arrays.items():
            offsets[name] = num_bytes
            num_bytes += -(-array.size * dtype.itemsize // ALIGN_BYTES) * ALIGN_BYTES
        if self._copied is not None:
            self._copied.synchronize()  # recorded after the last copy: already done, save after a draft pass
        host, device = self._buffers(num_bytes)
        packed = host.numpy()
        for name, (array, dtype) in arrays.items():
            start = offsets[name]
            view = packed[start:start + array.size * dtype.itemsize].view(_NUMPY_DTYPES[dtype])
            view[:] = array.reshape(-1)  # numpy casts as it copies
        device[:num_bytes].copy_(host[:num_bytes], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return {name: device[offsets[name]:offsets[name] + array.size * dtype.itemsize].view(dtype).view(array.shape)
                for name, (array, dtype) in arrays.items()}

    def _buffers(self, num_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host.numel() < num_bytes:
            size = max(MIN_BUFFER_BYTES, 2 * num_bytes)
            host = torch.empty(size, dtype=torch.uint8)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
            self._device = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._host, self._device


_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}
