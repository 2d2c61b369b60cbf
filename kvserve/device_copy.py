"""Host data onto a device without waiting for the device: ``to_device``.

torch copies pageable host memory to a CUDA device synchronously (it waits on the stream, so that the host
buffer may be reused at once). Inside a step that makes the host wait for the forward pass queued before it:
the overlapped engine loop, which detokenizes the last step's outputs while the device runs this one, would
wait there instead. Pinned memory (torch's caching host allocator keeps the block until the copy has run) and
a non-blocking copy keep the step's one sync where it belongs, at the read of the sampled token ids.
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
