"""The repetition, presence and frequency penalties, from token counts kept on the logits' device.

Each sample with a penalty holds a slot: a row of ``counts`` [slots, V] (its outputs so far) and of
``in_prompt`` [slots, V] (its prompt's tokens, for the repetition penalty). The prompt is sent once, when the
sample first appears; after that a step adds only its new tokens, and a step without speculation adds them on
the device as soon as they are sampled (``accept_launched``), before they are read back. So a step costs no
host work in proportion to a history, and a penalized row may be sampled again while its last token is still
in flight (the overlapped scheduler): its counts already hold that token.

    per sample: counted = the outputs its slot holds; known = the outputs read back
      launch, no speculation -> counted + 1, the sampled token added on the device     (accept_launched)
      read back              -> known + n; tokens past counted added (speculated ones)   (accept)
      apply                  -> the slot's counts, plus the row's outputs past counted (a speculating
                                request's later rows: the drafts before them)
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvserve.device_copy import to_device
from kvserve.sample.processor import LogitsProcessor, token_counts
from kvserve.sample.metadata import SamplingRow

_MIN_SLOTS = 8


class Penalties(LogitsProcessor):
    """The repetition penalty (the logits of tokens seen in the prompt or the outputs: positive ones divided by
    it, negative ones multiplied), then the presence and frequency penalties (``frequency * count + presence *
    (count > 0)`` over the outputs, subtracted), in vLLM's order."""

    is_stateful = True

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._counted: dict[str, int] = {}
        self._known: dict[str, int] = {}
        self._free: list[int] = []
        self._capacity = 0
        self._unfilled: dict[str, SamplingRow] = {}  # keys whose slot ``apply`` fills from their first row
        self._late: list[tuple[int, list[int]]] = []  # (slot, tokens) read back, not in the slot yet
        self.counts: torch.Tensor | None = None  # float32 [slots, V], on the logits' device
        self.in_prompt: torch.Tensor | None = None  # bool [slots, V]

    def is_needed(self, row: SamplingRow) -> bool:
        p = row.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def reads_history(self, row: SamplingRow) -> bool:
        return False  # the counts on the device hold a token still in flight

    def add(self, key: str, row: SamplingRow) -> None:
        if self.is_needed(row):
            self._slot[key] = self._take_slot()
            self._counted[key] = self._known[key] = len(row.output_token_ids)
            self._unfilled[key] = row

    def accept_launched(self, rows: Sequence[SamplingRow], token_ids: torch.Tensor) -> None:
        """Each row's token, just sampled and still on the device, added to its slot."""
        entries = [(i, self._slot[r.generator_key]) for i, r in enumerate(rows) if r.generator_key in self._slot]
        if not entries:
            return
        assert self.counts is not None  # ``apply`` filled every slot of these rows
        row_ids, slots = zip(*entries)
        for i in row_ids:
            self._counted[rows[i].generator_key] += 1
        device = token_ids.device
        tokens = token_ids[to_device(list(row_ids), torch.long, device)]
        self.counts.index_put_((to_device(list(slots), torch.long, device), tokens),
                               torch.ones(len(slots), device=device), accumulate=True)

    def accept(self, key: str, token_ids: Sequence[int]) -> None:
        if key not in self._slot:
            return
        self._known[key] += len(token_ids)
        missing = self._known[key] - self._counted[key]
        if missing > 0:  # not counted at launch (a speculating step)
            self._late.append((self._slot[key], list(token_ids[len(token_ids) - missing :])))
            self._counted[key] = self._known[key]

    def drop(self, key: str) -> None:
        slot = self._slot.pop(key, None)
        if slot is None:
            return
        self._free.append(slot)
        del self._counted[key], self._known[key]
        self._unfilled.pop(key, None)
        self._late = [(s, tokens) for s, tokens in self._late if s != slot]
        if not self._slot:  # the storage is held only while some sample has a penalty
            self._release()

    @property
    def num_states(self) -> int:
        return len(self._slot)

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        selected = [i for i, r in enumerate(rows) if self.is_needed(r)]
        if not selected:
            return
        self._fill(logits.shape[1], logits.device)
        assert self.counts is not None and self.in_prompt is not None
        keys = [rows[i].generator_key for i in selected]
        slots = to_device([self._slot[k] for k in keys], torch.long, logits.device)
        counts = self.counts[slots]
        extra = [rows[i].output_token_ids[self._counted[k] :] for i, k in zip(selected, keys)]
        if any(len(tokens) for tokens in extra):  # a speculating request's rows after its first: the drafts
            counts += token_counts(extra, logits.shape[1], logits.device)
        present = counts > 0
        index = to_device(selected, torch.long, logits.device)
        sub = logits[index]
        params = [rows[i].params for i in selected]
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = _column([p.repetition_penalty for p in params], sub)
            seen = self.in_prompt[slots].logical_or_(present)
            sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        if any(p.frequency_penalty != 0.0 for p in params):
            sub -= counts.mul_(_column([p.frequency_penalty for p in params], sub))
        if any(p.presence_penalty != 0.0 for p in params):
            sub -= present * _column([p.presence_penalty for p in params], sub)
        logits[index] = sub

    # ---- slots ------------------------------------------------------------------------------------------

    def _take_slot(self) -> int:
        if not self._free:
            grown = max(_MIN_SLOTS, 2 * self._capacity)
            self._free = list(reversed(range(self._capacity, grown)))
            self._capacity = grown
            self._grow()
        return self._free.pop()

    def _release(self) -> None:
        """Give the storage back ([slots, V]: 335 MB for 256 samples of a 262,144-token vocabulary)."""
        self._free, self._capacity, self._late = [], 0, []
        self.counts = self.in_prompt = None

    def _grow(self) -> None:
        """Storage for every slot, once its vocabulary and device are known (the first ``apply``)."""
        if self.counts is None or self.in_prompt is None or self.counts.shape[0] >= self._capacity:
            return
        extra = self._capacity - self.counts.shape[0]
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.counts.shape[1])])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(extra, self.in_prompt.shape[1])])

    def _fill(self, vocab_size: int, device: torch.device) -> None:
        """Make the storage, fill the slots of new samples from their first row, add the late tokens."""
        if self.counts is None:
            self.counts = torch.zeros(self._capacity, vocab_size, device=device)
            self.in_prompt = torch.zeros(self._capacity, vocab_size, dtype=torch.bool, device=device)
        assert self.in_prompt is not None
        if self._unfilled:
            keys = list(self._unfilled)
            slots = to_device([self._slot[k] for k in keys], torch.long, device)
            rows = [self._unfilled.pop(k) for k in keys]
            self.counts[slots] = token_counts([r.output_token_ids for r in rows], vocab_size, device)
            self.in_prompt[slots] = token_counts([r.prompt_token_ids for r in rows], vocab_size, device) > 0
        self._flush()

    def _flush(self) -> None:
        if not self._late:
            return
        assert self.counts is not None
        slots, tokens = zip(*self._late)
        self._late = []
        late = token_counts(tokens, self.counts.shape[1], self.counts.device)
        self.counts.index_add_(0, to_device(list(slots), torch.long, self.counts.device), late)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.dtype, like.device)[:, None]
