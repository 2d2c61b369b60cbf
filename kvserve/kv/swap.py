"""SwapSpace: the KV of requests preempted by swap (``--preemption-mode swap``), kept in host-tier rows until
they resume.

::

    swap-out:  request.block_ids  | b3 | b9 | b4: 3 of 4 slots |  --copy-->  held rows | r7 | r2 | r5 |  (blocks freed)
    swap-in:   held rows          | r7 | r2 | r5 |                --copy-->  fresh blocks | b1 | b6 | b8 | ...
                                                                            (rows released after the copy)

Every block holding the request's computed tokens is kept, the partly filled last one included, whether or not
the prefix tree names it: the request resumes with its ``num_computed_tokens`` and computes nothing again.
(At the swap-in, blocks that the prefix tree still holds on the device are taken back instead of loaded.) With
KV cache groups (``kv/groups.py``) that is every group's blocks, group after group, but a window group's only
from the first its next query sees: the blocks before (null entries, or dead ones not yet freed) get no row,
and the request's tables come back with nulls there.
The rows are taken out of the host tier (``TieredStore.hold_rows``), so nothing evicts, indexes or reuses
them while the request is swapped out; they are free again once the swap-in's copy is done, or once the
request finished while swapped out.

Only this module and the tiers know rows: the KV manager hands it block ids, and the copies leave as
``KVTransferPlan.swap_outs`` / ``swap_ins``, applied by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from kvserve.kv.tiers import TieredStore


@dataclass(frozen=True)
class SwappedKV:
    """Where a swapped-out request resumes: its own KV of ``num_tokens`` computed tokens, kept in host rows and
    loaded back by ``KVCacheManager.allocate_slots``. What ``match_prefix`` gives such a request in place of a
    ``PrefixMatch``; it answers the two questions the scheduler asks of either."""

    num_tokens: int  # the request's computed tokens when it was swapped out: it resumes with all of them

    @property
    def must_wait(self) -> bool:
        """Never: the whole KV is in host rows already."""
        return False


@dataclass(frozen=True)
class _SwapRows:
    """A swapped-out request's rows: the host rows holding its first ``len(rows)`` blocks, in order."""

    rows: tuple[int, ...]
    num_tokens: int  # the request's computed tokens when it was swapped out


@dataclass
class SwapCounters:
    """Since start. A fallback is a swap-out the host tier could not take (its rows all pinned or held):
    that request was preempted by recompute instead."""

    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0  # loaded back
    num_blocks_found_on_device: int = 0  # not loaded back: the prefix tree still held them on the device
    num_fallbacks: int = 0


class SwapSpace:
    """The swapped-out requests' rows, the copies planned since the last ``take_transfers``, and the rows to give
    back. A row goes back to the host tier only at the ``take_transfers`` after the plan that last copies
    through it: until that plan is applied, an offload of the same plan could otherwise take the row and be
    overwritten by the swap-out's copy (a request finished between ``schedule`` and ``execute``), or overwrite
    it before the swap-in's copy reads it."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.counters = SwapCounters()
        self._swapped: dict[str, _SwapRows] = {}
        self._outs: list[tuple[int, int]] = []  # (block_id, row), planned since the last take
        self._ins: list[tuple[int, int]] = []  # (row, block_id), planned since the last take
        self._dropped: list[int] = []  # rows of requests finished while swapped out, since the last take
        self._copied_in: list[int] = []  # rows of the swap-ins the last take handed over

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._swapped

    def resume_point(self, request_id: str) -> SwappedKV:
        """Where the swapped-out request resumes."""
        return SwappedKV(self._swapped[request_id].num_tokens)

    def swap_out(self, request_id: str, block_ids: list[int], num_tokens: int) -> bool:
        """Plan the copy of ``block_ids`` (the blocks of the request's ``num_tokens`` computed tokens) into
        rows held for it. False, planning nothing, when the host tier cannot give that many rows."""
        rows = self.store.hold_rows(len(block_ids))
        if rows is None:
            self.counters.num_fallbacks += 1
            return False
        self._swapped[request_id] = _SwapRows(tuple(rows), num_tokens)
        self._outs.extend(zip(block_ids, rows))
        self.counters.num_swapped_out += 1
        self.counters.num_blocks_swapped_out += len(rows)
        return True

    def swap_in(self, request_id: str, block_ids: Sequence[int | None]) -> None:
        """Plan the copy of the request's rows, in order, into ``block_ids``; a row whose entry is None, its block
        found still on the device, is only given back."""
        swapped = self._swapped.pop(request_id)
        if len(block_ids) != len(swapped.rows):
            raise ValueError(f"{len(block_ids)} blocks for the {len(swapped.rows)} rows of request {request_id}")
        ins = [(row, block_id) for row, block_id in zip(swapped.rows, block_ids) if block_id is not None]
        # rows found on the device are only given back (at the next take), and a swap-out into them not handed over
        # yet (a sample parked by ``fork_swapped`` in the update just before) is not copied at all: that take
        # releases the rows before its plan's offloads reserve theirs, so the copy would overwrite an offload's row
        found = {row for row, block_id in zip(swapped.rows, block_ids) if block_id is None}
        if found:
            self._outs = [(block_id, row) for block_id, row in self._outs if row not in found]
            self._dropped.extend(found)
        self._ins.extend(ins)
        self.counters.num_swapped_in += 1
        self.counters.num_blocks_swapped_in += len(ins)
        self.counters.num_blocks_found_on_device += len(swapped.rows) - len(ins)

    def drop(self, request_id: str) -> None:
        """The request finished while swapped out (a no-op if it is not): its rows go back to the host tier
        with the next ``take_transfers``, and a swap-out of it not handed over yet is not copied at all."""
        swapped = self._swapped.pop(request_id, None)
        if swapped is None:
            return
        rows = set(swapped.rows)
        self._outs = [(block_id, row) for block_id, row in self._outs if row not in rows]
        self._dropped.extend(swapped.rows)

    def abandon(self) -> None:
        """Forget the swap-ins planned since the last ``take_transfers`` (a step raised before it was taken; their
        requests have finished): their rows go back with the next take, uncopied. (Swap-outs of finished requests
        are dropped by ``drop``.)"""
        self._dropped.extend(row for row, _ in self._ins)
        self._ins.clear()

    def swapped_in_blocks(self) -> set[int]:
        """The blocks the swap-ins planned since the last take copy KV into."""
        return {block_id for _, block_id in self._ins}

    def take_transfers(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """The swap-outs and swap-ins planned since the last call, for the runner to apply before the next
        forward pass. Rows whose last copy was in a plan taken before now go back to the host tier: the
        engine has applied that plan (it executes a step before it schedules the next)."""
        released = self._dropped + self._copied_in
        assert not set(released) & {row for _, row in self._outs}, "a host row released while a swap-out copies into it"
        self.store.release_rows(released)
        outs, ins = tuple(self._outs), tuple(self._ins)
        self._dropped, self._copied_in = [], [row for row, _ in ins]
        self._outs, self._ins = [], []
        return outs, ins

    def check_integrity(self, live_request_ids: Iterable[str]) -> None:
        """Only live requests are swapped out, and the host tier accounts for every row held here."""
        leaked = set(self._swapped) - set(live_request_ids)
        assert not leaked, f"finished requests still hold swapped-out KV: {sorted(leaked)}"
        held = [row for swapped in self._swapped.values() for row in swapped.rows]
        held += [row for row, _ in self._ins] + self._dropped + self._copied_in
        self.store.check_integrity(held)
