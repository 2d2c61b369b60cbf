"""Pooler: a pooling request's final hidden states, gathered over the chunks its prompt runs in and pooled.

A prompt may run in several chunks (chunked prefill), and a chunk's hidden states exist only in its step, so the
pooler keeps what each chunk contributes until the last one: nothing for ``LAST`` (the last chunk's last row is
the answer), the first row for ``CLS``, a running sum for ``MEAN``, every row for ``token_embed``. A chunk that
starts at position 0 starts the request over (recomputed after a preemption); one resumed from its swapped-out KV
goes on where it stopped."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.pooling_params import PoolingParams


@dataclass(frozen=True)
class PoolingRows:
    """One pooling request's chunk in a step: token rows ``first_row .. first_row + num_rows - 1`` of the step's
    hidden states, at positions ``start_pos ..``; ``is_last``: the chunk ends its prompt."""

    request_id: str
    first_row: int
    num_rows: int
    start_pos: int
    is_last: bool
    params: PoolingParams  # ``normalize`` filled in (``InputProcessor.process_pooling``)


class Pooler:
    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type  # ``ModelConfig.pooling_type``: how ``embed`` pools
        self._parts: dict[str, list[torch.Tensor]] = {}  # requests between chunks -> what their chunks gave

    def pool(self, chunks: list[PoolingRows], hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Take the step's pooling chunks from ``hidden`` [step tokens, hidden]; returns the requests whose prompt
        is done, each with its pooled states (float32, on the CPU)."""
        pooled = {}
        for chunk in chunks:
            states = hidden[chunk.first_row: chunk.first_row + chunk.num_rows]
            parts = [] if chunk.start_pos == 0 else self._parts.get(chunk.request_id, [])
            parts.append(self._contribution(chunk, states))
            if chunk.is_last:
                self._parts.pop(chunk.request_id, None)
                pooled[chunk.request_id] = self._finish(chunk, parts).cpu()
            else:
                self._parts[chunk.request_id] = parts
        return pooled

    def drop(self, request_ids: frozenset[str]) -> None:
        """Forget finished (or aborted) requests' chunks."""
        for request_id in request_ids:
            self._parts.pop(request_id, None)

    def _contribution(self, chunk: PoolingRows, states: torch.Tensor) -> torch.Tensor:
        """What a chunk adds, as float32 copies: a step's hidden states may live in a buffer the next step
        overwrites (a step graph's)."""
        if chunk.params.task == "token_embed":
            return states.to(torch.float32, copy=True)
        if self.pooling_type == "MEAN":
            return states.to(torch.float32).sum(dim=0)
        if self.pooling_type == "CLS":
            return states[0].to(torch.float32, copy=True) if chunk.start_pos == 0 else states.new_empty(0)
        return states[-1].to(torch.float32, copy=True) if chunk.is_last else states.new_empty(0)

    def _finish(self, chunk: PoolingRows, parts: list[torch.Tensor]) -> torch.Tensor:
        if chunk.params.task == "token_embed":
            result = torch.cat(parts)
        elif self.pooling_type == "MEAN":
            result = torch.stack(parts).sum(dim=0) / (chunk.start_pos + chunk.num_rows)
        else:  # CLS: the first chunk's row; LAST: the last one's
            result = parts[0] if self.pooling_type == "CLS" else parts[-1]
        return torch.nn.functional.normalize(result, dim=-1) if chunk.params.normalize else result
