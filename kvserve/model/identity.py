"""A fingerprint of a loaded model, the model identity that KV blocks' content keys chain from (``kv/block_keys.py``):
a block written for one model is never found under another's keys, on this server, a restarted one or another
sharing its disk tier.

Apart from the keys because it reads the weights (torch), which the scheduler's side of the KV store does without.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping

import torch

_BUILD_KEYS = ("transformers_version",)  # which library wrote the configuration: not the model


def model_identity(named_tensors: Iterable[tuple[str, torch.Tensor]], extra: str, config: Mapping[str, Any]) -> str:
    """A fingerprint of a loaded model that a block written for another model cannot share: its configuration
    (``config``, the model's own: rope, norms and windows shape its KV as much as the weights do; keys that start
    with ``_`` name where it was loaded from, and are left out), every tensor's name, shape, dtype, first and last
    bytes and two sums of its words, and ``extra`` (the device, dtypes, weight format, kernels). The words are summed
    as integers (wrapping), so the sums do not depend on the thread count that computes them: two processes agree;
    the second weighs each word by its position, so that rows swapped or values moved change it."""
    settings = {key: value for key, value in config.items() if not key.startswith("_") and key not in _BUILD_KEYS}
    digest = hashlib.blake2b(extra.encode(), digest_size=16)
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        flat = tensor.detach().reshape(-1)
        ends = torch.cat([flat[:32], flat[-32:]]).cpu().contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{_word_sums(flat)}|".encode())
        digest.update(ends.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


_CHUNK_WORDS = 2**22  # the position-weighted sum's temporaries: 32 MB at a time


def _word_sums(flat: torch.Tensor) -> tuple[int, int]:
    """The sum of a tensor's bytes read as int64 words (int32 words, or bytes, where its size or its offset in
    its storage is no multiple of 8), and the sum of each word times its position plus one."""
    data = flat.contiguous().view(torch.uint8)
    words = next((data.view(word) for word in (torch.int64, torch.int32)
                  if data.numel() % word.itemsize == 0 and data.storage_offset() % word.itemsize == 0), data)
    weighted = 0
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start:start + _CHUNK_WORDS].to(torch.int64)
        positions = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=chunk.device)
        weighted += int((chunk * positions).sum())
    return int(words.sum(dtype=torch.int64)), weighted
