"""PersistentBatch: the runner's own copy of the requests it runs, updated in place from each step's diff.

The scheduler names a request in full once (``NewRequestData``) and afterwards sends only its chunk and its
new blocks (``ScheduledRequest``); the runner appends the tokens it samples to its copy itself (vLLM v1's
persistent batch). So a step's host work is proportional to the tokens it runs, not to context or queue
length::

    rows (one per request in the batch, reused):   row r: token ids (prompt + outputs), sampling row
    block_table [groups, capacity, max_blocks_per_request]:
        group 0, row r: | b3 | b9 | b4 | 0 ... |   num_blocks[r] = 3
        group 1, row r: | -1 | b7 | b2 | 0 ... |   (KV cache groups, ``kv/groups.py``: a window group's freed
                                                    leading blocks are NULL_BLOCK)

``prepare`` gathers a step's rows of the persistent block table and its tokens into flat arrays (numpy,
vectorised per token), then hands them to the device: on CUDA all of them in one non-blocking copy from a
persistent pinned buffer (``worker/staging.py``); on CPU as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from kvserve.attention.backend import AttentionInputs, shared_prefixes
from kvserve.device_copy import to_device
from kvserve.kv.groups import NULL_BLOCK
from kvserve.model.layers.lora import LoRAMapping
from kvserve.pooling_params import PoolingParams
from kvserve.sample.metadata import SamplingBatch, SamplingRow
from kvserve.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
from kvserve.worker.pooler import PoolingRows
from kvserve.worker.staging import PinnedStaging

HostArrays = dict[str, tuple[np.ndarray, torch.dtype]]  # name -> (host array, the dtype it has on the device)


@dataclass(frozen=True)
class InputBatch:
    """The flat model inputs of one step, rows in the step's order (one-token rows first)."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: AttentionInputs
    sample_rows: torch.Tensor  # int64 [S + drafts]: the token rows whose hidden states sampling reads
    sample_request_ids: list[str]  # [S]
    sampling: SamplingBatch  # [S + drafts]: a row per sample row
    # [S]: a speculating request's drafts (it reads 1 + len(drafts) consecutive sample rows), else ()
    draft_token_ids: list[tuple[int, ...]]
    prompt_logprobs: list[PromptLogprobRows]
    lora: LoRAMapping | None = None  # the step's tokens by LoRA adapter; None: no row has one
    pooling: list[PoolingRows] = dataclasses.field(default_factory=list)  # the pooling requests' chunks


class StepLayout(NamedTuple):
    """A forward pass's token inputs and attention layout; ``query_start`` (host) has each query's first row;
    ``extra``, the arrays the caller sent with them."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: AttentionInputs
    query_start: np.ndarray  # int64 [B + 1]
    extra: dict[str, torch.Tensor]


@dataclass(frozen=True)
class PromptLogprobRows:
    """The rows of one request's chunk that predict prompt tokens, and those tokens."""

    request_id: str
    rows: torch.Tensor  # int64 [L]
    target_ids: torch.Tensor  # int64 [L]
    num_top: int


@dataclass(frozen=True)
class InFlightTokens:
    """The tokens a launched step samples, on the device and not read back yet: a step launched before they
    are (the overlapped scheduler) takes the input id of each request's newest position from them."""

    rows: dict[str, int]  # request id -> its row of token_ids
    token_ids: torch.Tensor  # int64 [S], on the device


@dataclass
class _Row:
    """One request as the runner knows it; ``output_token_ids`` is appended to by the runner, and both sampling
    rows share that list: ``sampling_ahead`` is the one a step launched with the request's last token still in
    flight samples with (its position one on)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingRow
    sampling_ahead: SamplingRow
    lora_id: int = 0
    pooling_params: PoolingParams | None = None


class PersistentBatch:
    """Owns the runner's rows and block tables; ``update`` applies a step's diff, ``prepare`` builds its
    inputs, ``append_sampled`` records the sampled tokens. ``staging`` sends a step's inputs to the device in
    one copy (default: on CUDA; on CPU they are used where numpy built them)."""

    def __init__(self, max_blocks_per_request: int, block_size: int, device: torch.device, capacity: int = 64,
                 num_groups: int = 1, staging: PinnedStaging | None = None):
        self.block_size = block_size
        self.device = device
        self.block_table = np.zeros((num_groups, capacity, max_blocks_per_request), dtype=np.int32)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)
        self._rows: list[_Row | None] = [None] * capacity
        self._index: dict[str, int] = {}  # request id -> row
        self._free_rows = list(reversed(range(capacity)))
        self._num_adapter_rows = 0  # requests with a LoRA adapter: without any, a step builds no mapping
        self._num_pooling_rows = 0  # pooling requests: without any, a step looks for no pooling chunk
        self._staging = staging or (PinnedStaging(device) if device.type == "cuda" else None)

    @property
    def num_requests(self) -> int:
        return len(self._index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._index

    def output_token_ids(self, request_id: str) -> list[int]:
        return self._row(request_id).output_token_ids

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        row = self._index[request_id]
        return self.block_table[group, row, : self.num_blocks[row]].tolist()

    # ------------------------------------------------------------------------------------------ the diff

    def update(self, sched_out: SchedulerOutput) -> None:
        """Apply a step's diff: drop finished and preempted requests (unknown ids are ignored: a request
        may finish before it ever ran), add new ones, append each scheduled request's new blocks."""
        for request_id in sched_out.finished_request_ids | sched_out.preempted_request_ids:
            self._remove(request_id)
        for new in sched_out.new_requests:
            self._add(new)
        for scheduled in sched_out.requests:
            self._append_blocks(scheduled)

    def append_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """Record the tokens the runner sampled, as the scheduler will append them to its requests."""
        for request_id, token_ids in sampled_token_ids.items():
            self._row(request_id).output_token_ids.extend(token_ids)

    def sampling_row(self, request_id: str) -> SamplingRow:
        return self._row(request_id).sampling

    def drop_rejected_blocks(self, request_id: str) -> None:
        """After a speculating row: keep only the blocks the request's known tokens need, as the scheduler
        does when it frees the blocks taken for rejected drafts (``ScheduledRequest``)."""
        index = self._index_of(request_id)
        row = self._rows[index]
        assert row is not None
        num_tokens = len(row.prompt_token_ids) + len(row.output_token_ids)
        num_held, num_kept = int(self.num_blocks[index]), -(-num_tokens // self.block_size)
        if num_kept < num_held:
            self.block_table[:, index, num_kept:num_held] = 0  # a table stays padded with 0
            self.num_blocks[index] = num_kept

    def _add(self, new: NewRequestData) -> None:
        if new.request_id in self._index:
            raise ValueError(f"request {new.request_id!r} is already in the runner's batch")
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        output_token_ids = list(new.output_token_ids)
        sampling = SamplingRow(new.sampling_params, new.sample_index, new.request_id, new.prompt_token_ids,
                               output_token_ids, new.eos_token_ids)
        self._rows[row] = _Row(new.request_id, new.prompt_token_ids, output_token_ids, sampling,
                               dataclasses.replace(sampling, num_in_flight=1), new.lora_id, new.pooling_params)
        self._index[new.request_id] = row
        self._num_adapter_rows += bool(new.lora_id)
        self._num_pooling_rows += new.pooling_params is not None
        self.block_table[:, row] = 0  # a row's table is padded with 0, whatever its last holder left there
        self.num_blocks[row] = 0
        self._set_blocks(row, new.block_ids)

    def _remove(self, request_id: str) -> None:
        row = self._index.pop(request_id, None)
        if row is not None:
            self._num_adapter_rows -= bool(self._rows[row].lora_id)
            self._num_pooling_rows -= self._rows[row].pooling_params is not None
            self._rows[row] = None
            self._free_rows.append(row)

    def _append_blocks(self, scheduled: ScheduledRequest) -> None:
        if scheduled.new_block_ids:
            self._set_blocks(self._index_of(scheduled.request_id), scheduled.new_block_ids)
        if scheduled.num_null_blocks:
            row = self._index_of(scheduled.request_id)
            for group, num_null in enumerate(scheduled.num_null_blocks):
                self.block_table[group, row, :num_null] = NULL_BLOCK

    def _set_blocks(self, row: int, block_ids: list[int] | tuple[int, ...]) -> None:
        """Append blocks to the row's tables: every group's, group after group, the same number each."""
        num_groups, max_blocks = self.block_table.shape[0], self.block_table.shape[2]
        start = int(self.num_blocks[row])
        num_new = len(block_ids) // num_groups
        end = start + num_new
        if end > max_blocks:
            raise ValueError(f"a block table of {end} blocks is over the {max_blocks} a request may hold")
        if num_groups == 1:
            self.block_table[0, row, start:end] = block_ids
        else:
            self.block_table[:, row, start:end] = np.reshape(block_ids, (num_groups, num_new))
        self.num_blocks[row] = end

    def _grow(self) -> None:
        """Double the rows (the batch may briefly hold more requests than max_running: n > 1 forks)."""
        capacity = len(self._rows)
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)], axis=1)
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._rows.extend([None] * capacity)
        self._free_rows.extend(reversed(range(capacity, 2 * capacity)))

    def _index_of(self, request_id: str) -> int:
        row = self._index.get(request_id)
        if row is None:
            raise ValueError(f"request {request_id!r} is scheduled but was never added to the runner's batch")
        return row

    def _row(self, request_id: str) -> _Row:
        row = self._rows[self._index_of(request_id)]
        assert row is not None
        return row

    # ------------------------------------------------------------------------------------ step inputs

    def prepare(self, sched_out: SchedulerOutput, in_flight: InFlightTokens | None = None) -> InputBatch:
        """The step's flat inputs; one Python pass over the step's requests, everything per token in numpy.
        A request's token one past those known is taken from ``in_flight`` on the device."""
        scheduled = sched_out.requests
        rows, start_pos, query_lens, tokens, unknown = self._gather(scheduled, in_flight)
        sampling = [i for i, r in enumerate(scheduled) if r.sample]
        draft_token_ids = [scheduled[i].draft_token_ids for i in sampling]
        sample_rows = _sample_rows(_query_start(query_lens), sampling, draft_token_ids)
        layout = self.layout(rows, start_pos, query_lens, tokens, {"sample_rows": (sample_rows, torch.int64)})
        if unknown:
            assert in_flight is not None
            flat, sampled = zip(*unknown)
            layout.input_ids[to_device(list(flat), torch.int64, self.device)] = \
                in_flight.token_ids[to_device(list(sampled), torch.int64, self.device)]
        query_start = layout.query_start
        return InputBatch(
            input_ids=layout.input_ids,
            positions=layout.positions,
            attn=layout.attn,
            sample_rows=layout.extra["sample_rows"],
            sample_request_ids=[scheduled[i].request_id for i in sampling],
            draft_token_ids=draft_token_ids,
            sampling=SamplingBatch.of_requests([self._sampling_row(scheduled[i].request_id, rows[i], in_flight)
                                                for i in sampling], draft_token_ids),
            prompt_logprobs=[  # a comprehension's := binds in this function: a name of its own, not ``rows``
                logprob_rows for i, r in enumerate(scheduled) if r.prompt_logprobs
                if (logprob_rows := self._prompt_logprob_rows(r, int(query_start[i]))) is not None
            ],
            lora=self._lora_mapping(rows, query_lens),
            pooling=self._pooling_rows(scheduled, rows, query_start) if self._num_pooling_rows else [],
        )

    def _pooling_rows(self, scheduled: Sequence[ScheduledRequest], rows: np.ndarray,
                      query_start: np.ndarray) -> list[PoolingRows]:
        """The chunks the step runs of pooling requests' prompts."""
        chunks = []
        for i, (r, index) in enumerate(zip(scheduled, rows)):
            row = self._rows[index]
            if row.pooling_params is not None:
                end = r.start_pos + r.num_tokens
                chunks.append(PoolingRows(r.request_id, int(query_start[i]), r.num_tokens, r.start_pos,
                                          end == len(row.prompt_token_ids), row.pooling_params))
        return chunks

    def _lora_mapping(self, rows: np.ndarray, query_lens: np.ndarray) -> LoRAMapping | None:
        """The step's token rows grouped by the LoRA adapter of their request (None where no request has one)."""
        if not self._num_adapter_rows:
            return None
        adapters = np.fromiter((self._rows[row].lora_id for row in rows), np.int64, len(rows))
        if not adapters.any():
            return None
        return LoRAMapping.of_tokens(np.repeat(adapters, query_lens), self.device)

    def _sampling_row(self, request_id: str, row: int, in_flight: InFlightTokens | None) -> SamplingRow:
        """The row's sampling state; a request whose last token is still in flight draws one position on."""
        state = self._rows[row]
        assert state is not None
        return state.sampling_ahead if in_flight is not None and request_id in in_flight.rows else state.sampling

    def layout(self, rows: np.ndarray, start_pos: np.ndarray, query_lens: np.ndarray, tokens: list[int],
               extra: HostArrays | None = None) -> StepLayout:
        """The flat inputs of a forward pass that runs ``query_lens[i]`` tokens of the request in batch row
        ``rows[i]`` from position ``start_pos[i]`` on (one-token queries first, as the backends expect),
        ``tokens`` all of them in order; the KV slots come from the rows' block tables. ``extra`` arrays go
        to the device with them (``StepLayout.extra``)."""
        query_start = _query_start(query_lens)
        seq_lens = start_pos + query_lens
        num_tokens = int(query_start[-1])
        seq_of_token = np.repeat(np.arange(len(rows)), query_lens)
        positions = np.arange(num_tokens) - query_start[seq_of_token] + start_pos[seq_of_token]
        width = max(1, int(self.num_blocks[rows].max(initial=0)))
        arrays: HostArrays = {
            "input_ids": (np.array(tokens, dtype=np.int64), torch.int64),
            "positions": (positions, torch.int64),
            "query_start_loc": (query_start, torch.int32),
            "seq_lens": (seq_lens, torch.int32),
        }
        num_decodes = int(np.count_nonzero(query_lens == 1))
        num_groups = self.block_table.shape[0]  # KV cache groups (``kv/groups.py``): a table each
        shared = [self._add_group_arrays(arrays, group, rows, width, seq_of_token, positions, seq_lens, num_decodes)
                  for group in range(num_groups)]
        sent = self._send({**arrays, **(extra or {})})
        common = AttentionInputs(
            num_decodes=num_decodes,
            query_start_loc=sent["query_start_loc"],
            seq_lens=sent["seq_lens"],
            query_lens_list=query_lens.tolist(),
            seq_lens_list=seq_lens.tolist(),
            block_size=self.block_size,
            **_group_inputs(sent, 0, shared[0]),
        )
        # group 0's layout through the other groups' own tables (a new token never lies in a null block: those
        # end before the window of the step's first query)
        groups = tuple(dataclasses.replace(common, **_group_inputs(sent, group, shared[group]))
                       for group in range(1, num_groups))
        attn = dataclasses.replace(common, groups=groups) if groups else common
        return StepLayout(sent["input_ids"], sent["positions"], attn, query_start,
                          {name: sent[name] for name in extra or {}})

    def _add_group_arrays(self, arrays: HostArrays, group: int, rows: np.ndarray, width: int,
                          seq_of_token: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray,
                          num_decodes: int) -> int:
        """Add KV cache group ``group``'s block tables, slot mapping and decode sharing to ``arrays``; returns the
        most keys a decode of the step shares with others in that group."""
        block_tables = self.block_table[group, rows, :width]
        lens, order = shared_prefixes(block_tables[:num_decodes], seq_lens[:num_decodes], self.block_size)
        arrays[f"block_tables{group}"] = (block_tables, torch.int32)
        arrays[f"slot_mapping{group}"] = (self._slot_mapping(block_tables, seq_of_token, positions), torch.int64)
        arrays[f"shared_prefix_lens{group}"] = (lens, torch.int32)
        arrays[f"sharing_order{group}"] = (order, torch.int32)
        return int(lens.max(initial=0))

    def _slot_mapping(self, block_tables: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray) -> np.ndarray:
        slot_mapping = block_tables[seq_of_token, positions // self.block_size].astype(np.int64) * self.block_size
        slot_mapping += positions % self.block_size
        return slot_mapping

    def rows_of(self, request_ids: list[str]) -> np.ndarray:
        """The batch rows of the given requests (for ``layout``)."""
        return np.array([self._index_of(request_id) for request_id in request_ids], dtype=np.int64)

    def token_ids(self, request_id: str, start: int, end: int) -> list[int]:
        """The request's known tokens at positions ``start .. end - 1`` (prompt, then outputs)."""
        row = self._row(request_id)
        return _slice(row.prompt_token_ids, row.output_token_ids, start, end)

    def _gather(self, scheduled: Sequence[ScheduledRequest], in_flight: InFlightTokens | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], list[tuple[int, int]]]:
        """Each scheduled request's row, start position and token count, the token ids the step runs, in
        order, and for each token still in flight its index among them and its row of ``in_flight`` (its id
        is 0 here): one pass, as a decode step's host time is this loop's per-request cost times the batch."""
        rows = [self._index_of(r.request_id) for r in scheduled]
        tokens: list[int] = []
        unknown: list[tuple[int, int]] = []
        for r, index in zip(scheduled, rows):
            row = self._rows[index]
            prompt, outputs = row.prompt_token_ids, row.output_token_ids
            start, end = r.start_pos, r.start_pos + r.num_tokens - len(r.draft_token_ids)
            num_known = len(prompt) + len(outputs)
            if end == num_known + 1 and in_flight is not None and r.request_id in in_flight.rows:
                tokens += _slice(prompt, outputs, start, num_known)
                unknown.append((len(tokens), in_flight.rows[r.request_id]))
                tokens.append(0)
            elif end > num_known:
                raise ValueError(
                    f"request {r.request_id!r} is scheduled up to position {end - 1}, but the runner knows "
                    f"only {num_known} of its tokens"
                )
            else:
                tokens += _slice(prompt, outputs, start, end)
            tokens += r.draft_token_ids
        starts = np.fromiter((r.start_pos for r in scheduled), np.int64, len(scheduled))
        lengths = np.fromiter((r.num_tokens for r in scheduled), np.int64, len(scheduled))
        return np.array(rows, dtype=np.int64), starts, lengths, tokens, unknown

    def _prompt_logprob_rows(self, scheduled: ScheduledRequest, first_row: int) -> PromptLogprobRows | None:
        """Rows of a chunk whose next token is still a prompt token: position p predicts prompt[p + 1].

            chunk positions:   s ......................... s+L-1
            predict prompt:    s+1 ........ P-1               (P = num prompt tokens; p + 1 < P)
        """
        row = self._row(scheduled.request_id)
        start, prompt = scheduled.start_pos, row.prompt_token_ids
        last = min(start + scheduled.num_tokens, len(prompt) - 1)  # exclusive end of predicting positions
        if last <= start:
            return None
        return PromptLogprobRows(
            request_id=scheduled.request_id,
            rows=torch.arange(first_row, first_row + last - start, device=self.device),
            target_ids=to_device(prompt[start + 1 : last + 1], torch.int64, self.device),
            num_top=row.sampling.params.prompt_logprobs or 0,
        )

    def _send(self, arrays: HostArrays) -> dict[str, torch.Tensor]:
        """The arrays on the device: on CUDA in one copy (``PinnedStaging``), on CPU as they are."""
        if self._staging is not None:
            return self._staging.send(arrays)
        return {name: torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
                for name, (array, dtype) in arrays.items()}


def _group_inputs(sent: dict[str, torch.Tensor], group: int, max_shared_prefix_len: int) -> dict[str, Any]:
    """The fields of ``AttentionInputs`` that KV cache group ``group``'s own table decides, from the sent arrays."""
    return {"block_tables": sent[f"block_tables{group}"], "slot_mapping": sent[f"slot_mapping{group}"],
            "shared_prefix_lens": sent[f"shared_prefix_lens{group}"], "sharing_order": sent[f"sharing_order{group}"],
            "max_shared_prefix_len": max_shared_prefix_len}


def _query_start(query_lens: np.ndarray) -> np.ndarray:
    """Each query's first row in the step's flat token batch, and the total: int64 [B + 1]."""
    query_start = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    return query_start


def _slice(prompt: list[int], outputs: list[int], start: int, end: int) -> list[int]:
    """Positions ``start .. end - 1`` of prompt + outputs, without concatenating them."""
    num_prompt = len(prompt)
    if start >= num_prompt:
        return outputs[start - num_prompt : end - num_prompt]
    return prompt[start:end] + outputs[: max(0, end - num_prompt)]


def _sample_rows(query_start: np.ndarray, sampling: list[int], drafts: list[tuple[int, ...]]) -> np.ndarray:
    """The token rows sampling reads: each sampling request's last row, and a speculating request's
    1 + len(draft) last rows (its last sampled token and each draft token)."""
    last_rows = query_start[1:][sampling] - 1
    if not any(drafts):
        return last_rows
    counts = np.array([1 + len(d) for d in drafts], dtype=np.int64)
    starts = np.cumsum(counts) - counts  # where each request's rows begin in the result
    offsets = np.arange(int(counts.sum())) - np.repeat(starts, counts)  # 0 .. count - 1 within each request
    return np.repeat(last_rows - counts + 1, counts) + offsets
