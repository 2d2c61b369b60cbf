"""Host-memory and disk tiers under the device's KV pool: blocks the prefix tree lets go of, kept by content.

::

    device pool (BlockPool)  --evicted block-->  host tier (slab of slots, LRU)  --write-->  disk tier (files)
             ^                                        |    ^                                    |
             +---------------- load on a hit ---------+    +------ prefetch on a hit, verified --+

Blocks are named by their content key (``block_keys``), so the tiers need no tree of their own: a request
whose prefix runs past the device tree looks its next blocks' keys up here. The tiers are inclusive: a block
may sit in the device pool, the host slab and on disk at once. With KV cache groups (``kv/groups.py``) a block id
holds one group's layers, so every group's block of the same tokens is a block of its own here, under its group's
key; the KV manager decides which of them a prefix needs.

- **Host tier** (``--kv-offload-memory``): a preallocated slab of block-sized rows (pinned on CUDA), least
  recently used first out. It takes the blocks the device pool evicts, and it stages every disk read and write.
  Under ``--preemption-mode swap`` it also lends rows, held out of the LRU and the index, to the KV of
  preempted requests (``hold_rows``, ``kv/swap.py``).
- **Disk tier** (``--kv-offload-dir``, ``--kv-offload-disk``): one file a block (``block_file``), written
  through as soon as a block is computed, so that a restarted server, or a second one on the same directory,
  finds it; oldest files out past the capacity.

The KV manager plans every move; the runner only copies bytes (``worker/kv_transfers.py``). When the manager hands
a step's plan over (``KVCacheManager.take_tier_transfers``), this store picks the host rows of its offloads and
loads, so the plan carries rows, and the runner needs the slab, never this store::

    schedule N:  match (locate, prefetch, pin loads)  ...  take: reserve offload rows; load rows, unpin
    execute N:   the runner copies: offloads into their rows (then publish_offloads: their keys are found from now
                 on, and the writer thread may read them, while the step's forward pass runs), loads out of theirs

An offload's key is published only once its bytes are in its row, so a step that raises before its copies leaves
no key over a row that was never written (``abandon_offloads`` gives the reserved rows back). Unpinning a load's
row before its copy is safe: rows change hands only on the engine thread while it plans (``prefetch``,
``hold_rows``, the next take), which it does only once the runner has applied this plan (on CUDA its copies are
queued before the step's tokens, which the engine waits for). The one reader that does not wait for that is the
writer thread, so a block's write is queued only once it is in its row, and its row stays pinned until written.

Nothing here runs I/O on the step's critical path: file writes and reads run on a writer and a reader thread. A
disk hit is *prefetched* into the slab while the request waits (other requests keep running) and counts as a hit
only once verified, so a truncated, corrupt or foreign file is skipped before anyone relies on it. A full or
unwritable disk turns writing off with one warning; reads and the host tier go on.

Threads: the engine thread calls everything public; the two I/O threads touch the slab rows of their reads and
writes and, under ``_lock``, the indexes. Locking is coarse; the critical sections are dict operations.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from kvserve.kv.block_file import CorruptBlockError
from kvserve.kv.block_keys import KeyedBlock, root_key
from kvserve.kv.disk_tier import DIRECTORY_WIDE_ERRORS, BlockFormat, DiskTier, IOThread, list_directory
from kvserve.kv.host_tier import HostTier

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_STAGING_GIB = 0.25  # the host slab when only a disk tier is asked for: it stages reads and writes
CLOSE_SECONDS = 5.0  # how long closing the tiers waits for an I/O thread (queued writes are flushed before)


class Tier(enum.Enum):
    HOST = "host"
    DISK = "disk"


@dataclass
class TierCounters:
    """Since start: tokens hit per tier (with KV cache groups, those of group 0's blocks), blocks and bytes planned
    to move each way, disk events. (The runner times the copies: ``HostCopies``.)"""

    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    blocks_offloaded: int = 0
    bytes_offloaded: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    blocks_dropped: int = 0  # offloads skipped: every host row was pinned
    disk_writes: int = 0
    disk_write_errors: int = 0
    disk_reads: int = 0
    disk_read_seconds: float = 0.0
    disk_reads_skipped: int = 0  # blocks on the disk that were recomputed: reading measured slower
    corrupt_blocks: int = 0


class TieredStore:
    """The host and disk tiers behind one interface, the KV manager's: it asks where a key is, prefetches disk
    hits, pins blocks to load, says which blocks to offload, and has rows picked for each plan's copies."""

    def __init__(self, block_format: BlockFormat, host_bytes: float, host_is_tier: bool,
                 disk_dir: str | None = None, disk_bytes: float | None = None, pin_memory: bool = False) -> None:
        num_rows = int(host_bytes // block_format.bytes_per_block)
        if num_rows < 1:
            raise ValueError(f"the host KV tier ({host_bytes / 2**30:.3f} GiB) is smaller than one block "
                             f"({block_format.bytes_per_block} bytes); raise kv_offload_memory")
        self.format = block_format
        self.root_key = root_key(block_format.model_identity, block_format.kv_dtype, block_format.block_size,
                                 block_format.kv_layout)
        self.host_is_tier = host_is_tier  # False: the slab only stages disk I/O, evicted blocks skip it
        self.host = HostTier(num_rows, block_format.bytes_per_block, pin_memory)
        if disk_dir and disk_bytes is not None and disk_bytes < block_format.bytes_per_block:
            raise ValueError(f"the disk KV tier ({disk_bytes / 2**30:.3g} GiB) is smaller than one block "
                             f"({block_format.bytes_per_block} bytes); raise kv_offload_disk")
        disk_capacity = 2**62 if disk_bytes is None else int(disk_bytes)  # None: no bound (tests)
        self.disk = DiskTier(disk_dir, disk_capacity, block_format) if disk_dir else None
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._io_done = threading.Condition(self._lock)
        self._reading: set[bytes] = set()
        self._writing: set[bytes] = set()  # being written to the disk
        self._reserved: list[tuple[KeyedBlock, int]] = []  # offloads taken, not yet copied into their rows
        # blocks waiting requests will load: no offload or read evicts them (``keep_staged``)
        self._staged: frozenset[bytes] = frozenset()
        self._reader = IOThread("kvserve-kv-read") if self.disk else None
        self._writer = IOThread("kvserve-kv-write") if self.disk else None
        # a store dropped without close() (an LLM let go) stops its threads, which would live on with nothing to do
        weakref.finalize(self, _stop_threads, self._reader, self._writer)

    # ------------------------------------------------------------------------------ the KV manager's side

    def locate(self, key: bytes) -> Tier | None:
        """Where a usable copy of ``key``'s block is: the host tier (ready to load), the disk, or nowhere."""
        with self._lock:
            if key in self.host:
                return Tier.HOST
            if self.disk is not None and key not in self._reading and self.disk.has(key):
                return Tier.DISK
            return None

    def is_reading(self, key: bytes) -> bool:
        with self._lock:
            return key in self._reading

    def prefetch(self, blocks: Sequence[KeyedBlock]) -> int:
        """Start reading disk blocks into the host tier, in order, as long as rows can be reserved; returns how
        many are now on their way (already reading counts)."""
        assert self._reader is not None and self.disk is not None
        num_started = 0
        for block in blocks:
            with self._lock:
                if block.key not in self._reading:
                    row = self.host.reserve(keep=self._staged)
                    if row is None:
                        break
                    self._reading.add(block.key)
                    self._reader.submit(self._read, block, row)
            num_started += 1
        return num_started

    def keep_staged(self, keys: frozenset[bytes]) -> None:
        """The blocks waiting requests' matches found staged (or being read) in the host tier, until they load them:
        neither offloads nor reads take their rows (``TierMatcher``)."""
        with self._lock:
            self._staged = keys

    def staging_rows(self) -> int:
        """How many blocks the host tier can hold for loads at once: its rows free, holding unpinned blocks, or being
        read into (not those pinned for a load under way, nor those a swapped-out request holds)."""
        with self._lock:
            return self.host.num_unpinned_rows() + len(self._reading)

    def disk_read_cost(self) -> tuple[float | None, int]:
        """The measured seconds a block takes to come off the disk (one reader thread: a block's wall time;
        None before the first read), and how many reads measured it."""
        with self._lock:
            reads = self.counters.disk_reads
            return (self.counters.disk_read_seconds / reads if reads else None), reads

    def skip_reads(self, num_blocks: int) -> None:
        """Count disk blocks left to be recomputed because reading them measured slower."""
        with self._lock:
            self.counters.disk_reads_skipped += num_blocks

    def wants_offload(self, key: bytes, evicted: bool) -> bool:
        """Whether the device's copy of a computed block should be offloaded now: an evicted block to the host
        tier (and disk if it is not there yet); a newly computed one to the disk (written through)."""
        with self._lock:
            if key in self.host or key in self._writing:
                return False
            on_disk = self.disk is None or not self.disk.writable or self.disk.has(key)
            return (evicted and self.host_is_tier) or not on_disk

    def pin(self, keys: Sequence[bytes]) -> bool:
        """Keep these host blocks until the plan that loads them is taken (``take_load_rows``); False, pinning
        none, if one left the host tier since it was located."""
        with self._lock:
            if not all(key in self.host for key in keys):
                return False
            for key in keys:
                self.host.pin(key)
            return True

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Let go of blocks pinned for a load that will not be made."""
        with self._lock:
            for key in keys:
                self.host.unpin(key)

    def hold_rows(self, num_rows: int) -> list[int] | None:
        """Host rows kept out of the tier for the caller (``HostTier.hold``); None, taking none, if too few
        rows are free or unpinned. The caller gives them back with ``release_rows``."""
        with self._lock:
            return self.host.hold(num_rows)

    def release_rows(self, rows: Iterable[int]) -> None:
        with self._lock:
            for row in rows:
                self.host.release(row)

    def check_integrity(self, held_rows: list[int]) -> None:
        """Host rows are each free, indexed, held (``held_rows``: every row taken by ``hold_rows`` and not yet
        released), reserved for an offload or being read into. Raises AssertionError."""
        with self._lock:
            self.host.check_rows(held_rows + [row for _, row in self._reserved], len(self._reading))

    def wait_for_reads(self, timeout: float) -> None:
        """Block until no prefetch is under way, or ``timeout`` seconds (an idle engine waiting on the disk)."""
        with self._io_done:
            self._io_done.wait_for(lambda: not self._reading, timeout)

    @property
    def num_reading(self) -> int:
        with self._lock:
            return len(self._reading)

    # ------------------------------------------------------------------------- a plan's rows, as it is taken

    @property
    def host_slab(self) -> torch.Tensor:
        """The host rows' tensor, which the runner copies blocks into and out of."""
        return self.host.slab

    def reserve_offload_rows(self, blocks: Sequence[tuple[int, KeyedBlock]]) -> tuple[tuple[int, int], ...]:
        """Rows for a plan's offloads ((block_id, content) -> (block_id, row) pairs for the runner to copy), held
        out of the index until the copy (``publish_offloads``). A block finds no row when every row is pinned or
        held: it is dropped, counted."""
        with self._lock:
            rows = [self.host.reserve(keep=self._staged) for _ in blocks]
            kept = [(block_id, block, row) for (block_id, block), row in zip(blocks, rows) if row is not None]
            self._reserved.extend((block, row) for _, block, row in kept)
            self.counters.blocks_dropped += len(blocks) - len(kept)
        return tuple((block_id, row) for block_id, _, row in kept)

    def take_load_rows(self, loads: Sequence[tuple[bytes, int]]) -> tuple[tuple[int, int], ...]:
        """The rows of a plan's loads ((key, block_id) -> (row, block_id) pairs for the runner to copy), counting
        the hits; the blocks are unpinned now (safe before their copy: module docstring). Call it after the same
        plan's ``reserve_offload_rows``, whose reservations must not take these rows."""
        with self._lock:
            moves = tuple((self.host.row(key), block_id) for key, block_id in loads)
            for key, _ in loads:
                self._count_hit(key)
                self.host.unpin(key)
            self.counters.blocks_loaded += len(loads)
            self.counters.bytes_loaded += len(loads) * self.format.bytes_per_block
        return moves

    def _count_hit(self, key: bytes) -> None:
        """A block loaded: its tokens (group 0's) are a hit on the tier it came from; its file is used again."""
        from_disk = key in self.host.from_disk
        self.host.from_disk.discard(key)
        num_tokens = 0 if key in self.host.other_groups else self.format.block_size
        if from_disk:
            self.counters.disk_hit_tokens += num_tokens
        else:
            self.counters.host_hit_tokens += num_tokens
        if self.disk is not None and (from_disk or self.disk.indexed(key)):  # its file is there
            self.disk.touch(key)
            assert self._writer is not None
            self._writer.submit(self.disk.mark_used, key)

    def publish_offloads(self) -> None:
        """The runner has copied the reserved offloads into their rows: their keys are found from now on, and the
        writes of those the disk lacks are queued (their rows pinned until written)."""
        with self._lock:
            reserved, self._reserved = self._reserved, []
            writes = []
            for block, row in reserved:
                self.host.publish(block.key, row, block.group)
                if self._should_write(block.key):
                    self._writing.add(block.key)
                    self.host.pin(block.key)
                    writes.append((block, row))
            c = self.counters
            c.blocks_offloaded += len(reserved)
            c.bytes_offloaded += len(reserved) * self.format.bytes_per_block
        for block, row in writes:
            assert self._writer is not None
            self._writer.submit(self._write, block, row)

    def abandon_offloads(self) -> None:
        """A plan's offloads that were never copied (its step raised first): their rows go back, nothing is
        published."""
        with self._lock:
            for _, row in self._reserved:
                self.host.release(row)
            self._reserved.clear()

    # ------------------------------------------------------------------------------------ the I/O threads

    def _should_write(self, key: bytes) -> bool:
        disk = self.disk
        return disk is not None and disk.writable and key not in self._writing and not disk.indexed(key)

    def _write(self, block: KeyedBlock, row: int) -> None:
        assert self.disk is not None
        try:
            size = self.disk.write(block, memoryview(self.host.slab[row].numpy()))
        except OSError as error:
            whole_directory = error.errno in DIRECTORY_WIDE_ERRORS or not self.disk.is_directory()
            with self._lock:
                self.counters.disk_write_errors += 1
                was_writable = self.disk.writable
                stop = was_writable and whole_directory
                if stop:
                    self.disk.writable = False
            if stop:
                logger.warning("KV disk tier: writing to %s failed (%s); no more blocks are written there, "
                               "and prefixes not found in memory are recomputed", self.disk.directory, error)
            elif was_writable:  # the writes queued before a stop fail alike: said once, above
                logger.warning("KV disk tier: block file %s not written (%s)", self.disk.path(block.key), error)
        else:
            with self._lock:
                victims = self.disk.add(block.key, size)
                listing_due = self.disk.listing_due
                self.counters.disk_writes += 1
            for victim in victims:
                self.disk.remove(victim)
            if listing_due:
                self._trim_directory(block.key)
        finally:
            with self._io_done:
                self._writing.discard(block.key)
                self.host.unpin(block.key)
                self._io_done.notify_all()

    def _trim_directory(self, newest: bytes) -> None:
        """List the directory (unlocked: thousands of entries, other servers' writes among them) and remove its
        least recently used files, every server's, while it is over the capacity, but ``newest``."""
        assert self.disk is not None
        try:
            files, _ = list_directory(self.disk.directory)
        except OSError:
            return  # gone or unlistable: the next write or read says so
        with self._lock:
            victims = self.disk.trim(files, keep=newest)
        for victim in victims:
            self.disk.remove(victim)

    def _read(self, block: KeyedBlock, row: int) -> None:
        assert self.disk is not None
        start = time.perf_counter()
        try:
            self.disk.read(block, memoryview(self.host.slab[row].numpy()))
        except Exception as error:  # any file that cannot be used is skipped, and its row given back
            self._reject(block.key, row, error)
        else:
            with self._lock:
                self.host.publish(block.key, row, block.group)
                self.host.from_disk.add(block.key)
                self.counters.disk_reads += 1
                self.counters.disk_read_seconds += time.perf_counter() - start
        finally:
            with self._io_done:
                self._reading.discard(block.key)
                self._io_done.notify_all()

    def _reject(self, key: bytes, row: int, error: Exception) -> None:
        """A block file that cannot be used (unreadable, corrupt, or failing in a way not foreseen): skipped, counted,
        logged, and removed if it is corrupt."""
        assert self.disk is not None
        directory_gone = isinstance(error, OSError) and not self.disk.is_directory()
        with self._lock:
            self.host.release(row)
            forgotten = self.disk.forget_all() if directory_gone else 0
            self.disk.mark_bad(key)
            self.counters.corrupt_blocks += isinstance(error, CorruptBlockError)
        if directory_gone:
            if forgotten:  # the reads already queued find it gone too: said once
                logger.warning("KV disk tier: %s is no longer a directory (%s); the %d blocks indexed there are "
                               "forgotten, and those prefixes recomputed", self.disk.directory, error, forgotten)
        elif isinstance(error, FileNotFoundError):  # trimmed by another server sharing the directory
            logger.info("KV disk tier: block file %s is gone; recomputing it", self.disk.path(key))
        else:
            logger.warning("KV disk tier: skipping block file %s: %s", self.disk.path(key), error,
                           exc_info=not isinstance(error, (OSError, CorruptBlockError)))  # unforeseen: where from
        if isinstance(error, CorruptBlockError):
            self.disk.remove(key)

    # -------------------------------------------------------------------------------------------- the rest

    def clear(self) -> int:
        """Drop every block the tiers hold that nothing waits for (``reset_prefix_cache(reset_connector=True)``):
        the host tier's blocks but those pinned (a load planned, a write under way) or staged for a waiting
        request, and every file of this store's index of the disk tier but those being written or read (removed
        by the writer thread: no I/O here). Another server's files written since this one last listed the
        directory are not in the index, and stay. Returns how many blocks were dropped."""
        with self._lock:
            num_host = self.host.drop_unpinned(keep=self._staged)
            files = self.disk.drop_index(keep=self._writing | self._reading) if self.disk is not None else []
        if files:
            assert self._writer is not None and self.disk is not None
            self._writer.submit(_remove_files, self.disk, files)
        return num_host + len(files)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every disk write queued by ``publish_offloads`` and every read is done (shutdown, tests)."""
        with self._io_done:
            self._io_done.wait_for(lambda: not self._writing and not self._reading, timeout)

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Finish queued I/O and stop the I/O threads, waiting at most ``timeout`` seconds for each: one stuck
        in a hung filesystem is left behind (a daemon thread, it holds no process at exit), with a warning."""
        for thread in (self._reader, self._writer):
            if thread is not None and not thread.close(timeout):
                logger.warning("KV disk tier: %s still waits on %s after %.0f s (a hung filesystem?); left behind",
                               thread.name, self.disk.directory if self.disk else "the disk", timeout)

    def stats(self) -> dict[str, int | float | str]:
        c, bytes_per_block = self.counters, self.format.bytes_per_block
        with self._lock:
            host_blocks = self.host.num_blocks
            disk = self.disk
            disk_stats = {
                "kv_offload_disk_blocks": disk.num_blocks if disk else 0,
                "kv_offload_disk_bytes": disk.num_bytes if disk else 0,
                "kv_offload_disk_capacity_bytes": disk.capacity_bytes if disk else 0,
                "kv_offload_disk_writable": bool(disk and disk.writable),
            }
        return {
            "kv_offload_host_blocks": host_blocks,
            "kv_offload_host_bytes": host_blocks * bytes_per_block,
            "kv_offload_host_capacity_bytes": self.host.num_rows * bytes_per_block,
            **disk_stats,
            "kv_offload_host_hit_tokens": c.host_hit_tokens,
            "kv_offload_disk_hit_tokens": c.disk_hit_tokens,
            "kv_offload_blocks_offloaded": c.blocks_offloaded,
            "kv_offload_offloaded_bytes": c.bytes_offloaded,
            "kv_offload_blocks_loaded": c.blocks_loaded,
            "kv_offload_loaded_bytes": c.bytes_loaded,
            "kv_offload_blocks_dropped": c.blocks_dropped,
            "kv_offload_disk_writes": c.disk_writes,
            "kv_offload_disk_write_errors": c.disk_write_errors,
            "kv_offload_disk_reads": c.disk_reads,
            "kv_offload_disk_read_bandwidth_gbps": _gbps(c.disk_reads * bytes_per_block, c.disk_read_seconds),
            "kv_offload_disk_reads_skipped": c.disk_reads_skipped,
            "kv_offload_corrupt_blocks": c.corrupt_blocks,
        }


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def _remove_files(disk: DiskTier, keys: list[bytes]) -> None:
    for key in keys:
        disk.remove(key)


def _stop_threads(*threads: IOThread | None) -> None:
    for thread in threads:
        if thread is not None:
            thread.stop()
