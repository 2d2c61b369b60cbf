"""Host data onto a device, and device results back, without waiting for more of the device than needed:
``to_device``, ``HostCopy``.

torch copies pageable host memory to a CUDA device synchronously (it waits on the stream, so that the host
buffer may be reused at once). Inside a step that makes the host wait for the forward pass queued before it:
the overlapped engine loop, which detokenizes the last step's outputs while the device runs this one, would
wait there instead. Pinned memory (torch's caching host allocator keeps the block until the copy has run) and
a non-blocking copy keep the step's one sync where it belongs, at the read of the sampled token ids.

That read has the same trap the other way: a copy to pageable memory waits for everything queued on the stream,
and with the overlapped scheduler the next step is queued behind the sampling by then. ``HostCopy`` starts the
copy as soon as the tokens are sampled (into pinned memory, behind only the work queued so far) and its
``result`` waits for an event recorded right after it.
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``data`` (a sequence, a numpy array or a CPU tensor) as a ``dtype`` tensor on ``device``; on CPU it may
    share ``data``'s memory, as ``torch.as_tensor`` does."""
    host = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """``tensor`` copied to host memory: on CUDA started now, behind only the work queued so far, and waited for
    by ``result`` (a step queued after this one is not); elsewhere the tensor itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host
