"""DraftModel: the runner's side of draft-model speculation (``--speculative-method draft``).

The scheduler reserves k ``DRAFT_SLOT`` positions after a speculating decode's last token (``spec/proposer.py``);
before the target's forward pass the runner hands the step to ``fill``, which runs the draft model and puts its
greedy tokens in those slots. The target then verifies them as any draft (``sample/rejection.py``): a greedy
draft is a deterministic proposal, so output is exactly the target's. Per step that speculates::

    1 forward   every row's tokens the draft has not seen (its chunk, a decode's last token, tokens accepted
                last step past what the draft ran; a few of them as one-token queries each), one-token
                queries first  -> speculating rows' d1
    k-1 decodes the speculating rows with k > i, at position p + i, token d_i  -> d_{i+1}
                (p: the row's last known token; replayed from CPU step graphs where they serve)

The draft's KV lives in a ``KVCacheStorage`` of its own shape with as many blocks as the target's, indexed by
the same block ids: a request's block table covers both models, so the pool accounts for both (a block's bytes
are the sum, ``ModelRunner.kv_bytes_per_block``), rejected drafts' slots go with the target's, prefix hits and
fork copies carry the draft's KV too, and the scheduler knows nothing of it.

Per request, ``num_computed`` is how far the draft's KV is valid (positions ``0 .. num_computed - 1``)::

    tokens:      | ... known ... | x | d1 ... dj | y        x at p; j drafts accepted, then the target's y
    draft KV:    | ........................ | d_{k-1}       the draft ran x, d1 .. d_{k-1}
    valid after: p + 1 + min(j, k - 1)                    the next step runs [that, p + j + 2)

The draft runs in every step that runs more than one token for some request (a prefill chunk or a speculating
decode), over every row, so it computes every prompt position the target computes; in steps of plain one-token
decodes only (busy steps, where nobody speculates) it does not run, and those requests catch up in their next
speculating step. Where the draft's KV may be stale (lower acceptance, never a different output), seen through
a prefix hit by another request: blocks that a request filled with decode tokens in such steps, until it catches
up, and the last one or two tokens of a finished request (emitted after the draft's last pass).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.selector import select_backend
from kvserve.kv.quant import KVCacheDtype
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from kvserve.model.loader import Checkpoint
from kvserve.model.registry import load_model
from kvserve.sample.argmax import first_max
from kvserve.sched.output import ScheduledRequest, SchedulerOutput
from kvserve.worker.step_graphs import StepGraphs, step_graphs_for
from kvserve.worker.input_batch import PersistentBatch, StepLayout


# A request's unseen tokens up to this many run as one-token queries of their own, each over the same block
# table with its own length: the backends write a step's KV before attending, so each still sees the ones
# before it, and a pass of one-token queries is a decode step that a CPU step graph replays (the usual catch-up
# after every draft was accepted is 2 tokens: d_k and the target's token after it).
MAX_SPLIT_TOKENS = 4


class DraftModel:
    """Owns the draft model, its paged KV and, per request in the runner's batch, how far that KV is valid."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, block_size: int,
                 kv_dtype: KVCacheDtype, vocab_size: int, weights: str = "dense", quantize_activations: bool = False,
                 enforce_eager: bool = False, attention_backend: str | None = None) -> None:
        self.device = device
        self.vocab_size = vocab_size  # the target's: a draft's embeddings padded past it propose none of those
        self.dtype = dtype
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.backend: AttentionBackend = select_backend(device, dtype, attention_backend, kv_dtype=kv_dtype)
        self.model = load_model(checkpoint, self.backend, dtype, device, weights, quantize_activations)
        self.enforce_eager = enforce_eager
        self.kv: KVCacheStorage | None = None
        self.graphs: StepGraphs | None = None
        self._sliding_windows = self.model.sliding_windows()
        self._num_computed: dict[str, int] = {}  # request id -> positions whose draft KV is valid

    @property
    def num_requests(self) -> int:
        """Requests whose draft KV it tracks (those in the runner's batch)."""
        return len(self._num_computed)

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.model.kv_cache_spec(self.block_size, self.dtype, self.kv_dtype)

    def init_kv_cache(self, num_blocks: int, max_blocks_per_request: int) -> None:
        """The draft's KV, ``num_blocks`` blocks like the target's (block ids are shared); step graphs for its
        decode steps on CPU, as the target has (on CUDA the draft runs eagerly)."""
        self.kv = KVCacheStorage(self.kv_cache_spec(), num_blocks, self.device)
        self.graphs = step_graphs_for(self.model, self.backend, self.kv, self.device, max_blocks_per_request,
                                      self.enforce_eager)

    def drop(self, request_ids: frozenset[str]) -> None:
        """Forget requests that left the runner's batch (finished, or preempted: their blocks were freed)."""
        for request_id in request_ids:
            self._num_computed.pop(request_id, None)

    @torch.inference_mode()
    def fill(self, sched_out: SchedulerOutput, batch: PersistentBatch) -> SchedulerOutput:
        """The step with each speculating row's ``DRAFT_SLOT`` entries replaced by the draft's greedy tokens.
        ``batch`` holds the step's diff already (tokens, block tables). One Python pass over the rows."""
        rows = sched_out.requests
        for row in rows:  # a request entering the batch starts from the target's start: a prefix hit's blocks
            self._num_computed.setdefault(row.request_id, row.start_pos)  # were filled with the draft's KV too
        if not any(row.num_tokens > 1 for row in rows):
            return sched_out
        drafts = self._first_tokens(rows, batch)
        self._decode(rows, drafts, batch)
        if not drafts:
            return sched_out
        filled = [row._replace(draft_token_ids=tuple(drafts[row.request_id])) if row.request_id in drafts else row
                  for row in rows]
        return dataclasses.replace(sched_out, requests=filled)

    def record(self, sched_out: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> None:
        """After verification: a speculating row's draft KV is valid up to its last accepted draft that the
        draft model ran (``num_computed`` in the module docstring)."""
        for row in sched_out.requests:
            if row.draft_token_ids and row.request_id in sampled_token_ids:
                num_accepted = len(sampled_token_ids[row.request_id]) - 1
                end = _end(row)
                self._num_computed[row.request_id] = end + min(num_accepted, len(row.draft_token_ids) - 1)

    def copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """A fork's copy-on-write, applied to the draft's KV as the runner applies it to the target's."""
        assert self.kv is not None
        self.kv.copy_blocks(copies)

    def _first_tokens(self, rows: list[ScheduledRequest], batch: PersistentBatch) -> dict[str, list[int]]:
        """Run every row's tokens the draft has not seen; returns each speculating row's d1."""
        queries = []  # (request id, first position, end), one-token queries first
        for row in rows:
            start, end = min(self._num_computed[row.request_id], row.start_pos), _end(row)
            self._num_computed[row.request_id] = end
            if end - start <= MAX_SPLIT_TOKENS:
                queries += [(row.request_id, position, position + 1) for position in range(start, end)]
            else:
                queries.append((row.request_id, start, end))
        queries.sort(key=lambda query: query[2] - query[1] > 1)  # stable: a request's pieces stay in order
        request_ids = [request_id for request_id, _, _ in queries]
        starts = np.array([start for _, start, _ in queries], dtype=np.int64)
        ends = np.array([end for _, _, end in queries], dtype=np.int64)
        tokens = [t for request_id, start, end in queries for t in batch.token_ids(request_id, start, end)]
        layout = batch.layout(batch.rows_of(request_ids), starts, ends - starts, tokens)
        hidden = self._forward(layout)
        last_query = {request_id: i for i, request_id in enumerate(request_ids)}  # each request's last piece
        speculating = [row.request_id for row in rows if row.draft_token_ids]
        if not speculating:
            return {}
        token_ids = self._argmax(hidden, layout.query_start[1:][[last_query[r] for r in speculating]] - 1)
        return {request_id: [token] for request_id, token in zip(speculating, token_ids)}

    def _decode(self, rows: list[ScheduledRequest], drafts: dict[str, list[int]], batch: PersistentBatch) -> None:
        """Extend each speculating row's draft to its k tokens, one batched decode step per position."""
        speculating = [row for row in rows if row.draft_token_ids]
        for i in range(1, max((len(row.draft_token_ids) for row in speculating), default=0)):
            active = [row for row in speculating if len(row.draft_token_ids) > i]
            positions = np.array([_end(row) - 1 + i for row in active], dtype=np.int64)
            tokens = [drafts[row.request_id][-1] for row in active]
            layout = batch.layout(batch.rows_of([row.request_id for row in active]), positions,
                                  np.ones(len(active), dtype=np.int64), tokens)
            for row, token in zip(active, self._argmax(self._forward(layout), np.arange(len(active)))):
                drafts[row.request_id].append(token)

    def _forward(self, layout: StepLayout) -> torch.Tensor:
        """The draft's hidden states for a pass over ``layout``: replayed from a step graph where one serves."""
        if self.graphs is not None and (hidden := self.graphs.forward(*layout[:3])) is not None:
            return hidden
        meta = self.backend.build_metadata(layout.attn, self._sliding_windows)
        return self.model(layout.input_ids, layout.positions, meta, self.kv)

    def _argmax(self, hidden: torch.Tensor, rows: np.ndarray) -> list[int]:
        """The draft's greedy token at the given token rows (a host sync: the next pass needs them)."""
        index = torch.from_numpy(np.ascontiguousarray(rows)).to(hidden.device)
        return first_max(self.model.compute_logits(hidden[index])[:, : self.vocab_size]).tolist()


def _end(row: ScheduledRequest) -> int:
    """The end of the row's known tokens: its start plus the tokens it runs, drafts excluded."""
    return row.start_pos + row.num_tokens - len(row.draft_token_ids)
