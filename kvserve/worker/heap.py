"""Large CPU tensors kept in the allocator's heap between steps, not handed back to the kernel.

glibc serves an allocation above its mmap threshold (which it adjusts, up to 32 MiB) with a fresh ``mmap`` and
returns it with ``munmap`` when it is freed, so a step that makes such a tensor touches every one of its pages
anew: a 256 x 49,152 fp32 logits matrix (48 MiB) cost ~30 ms of page faults and ~7 ms of unmapping a step, and
as much again for each of the sampler's temporaries of its size, where smaller tensors are recycled at no cost.
That is from ~170 rows of SmolLM2's vocabulary, 32 of Gemma 3's. Fixed thresholds of ``KEPT_BYTES`` keep such
blocks in the heap for the next step, as jemalloc and tcmalloc (which CPU inference guides preload) do anyway:
what the heap keeps is what the steps use again. Process-wide, and glibc's only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform

logger = logging.getLogger(__name__)

KEPT_BYTES = 2**30  # an allocation larger than this still gets its own mapping, and the heap keeps this much free
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


@functools.cache
def keep_large_blocks() -> bool:
    """Set glibc's mmap and trim thresholds to ``KEPT_BYTES``, once a process; whether they are (False where
    the C library is not glibc). Both are needed: with the mmap threshold alone, the freed top of the heap went
    back to the kernel each step all the same."""
    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    kept = bool(mallopt(_M_MMAP_THRESHOLD, KEPT_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEPT_BYTES))
    if not kept:
        logger.warning("glibc refused the heap thresholds: each step maps its largest tensors anew")
    return kept
