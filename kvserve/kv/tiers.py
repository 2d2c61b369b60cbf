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

Nothing here runs I/O on the step's critical path. The runner's ``offload`` and ``load`` are memory copies
between the device and the slab; file writes and reads run on a writer and a reader thread. A disk hit is
*prefetched* into the slab while the request waits (other requests keep running) and counts as a hit only once
verified, so a truncated, corrupt or foreign file is skipped before anyone relies on it. A full or unwritable
disk turns writing off with one warning; reads and the host tier go on.

Threads: the engine thread calls everything public; the two I/O threads touch the slab rows they reserved and,
under ``_lock``, the indexes. Locking is coarse; the critical sections are dict operations.
"""

from __future__ import annotations

import enum
import errno
import functools
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from kvserve.kv.block_file import BlockRecord, CorruptBlockError, read_block_file, write_block_file
from kvserve.kv.block_keys import KeyedBlock, root_key
from kvserve.kv.storage import KVCacheStorage

logger = logging.getLogger(__name__)

FILE_SUFFIX = ".kvb"
DEFAULT_STAGING_GIB = 0.25  # the host slab when only a disk tier is asked for: it stages reads and writes
CLOSE_SECONDS = 5.0  # how long closing the tiers waits for an I/O thread (queued writes are flushed before)


class Tier(enum.Enum):
    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True)
class BlockFormat:
    """What every block of this engine's tiers is: a file is used only if it matches all of it."""

    model_identity: str
    kv_dtype: str  # the layout the KV is stored in (``KVCacheDtype.layout``)
    block_size: int
    bytes_per_block: int
    kv_layout: str = ""  # which layers a block of each KV cache group holds (``KVCacheGroups.layout``)

    def record(self, block: KeyedBlock) -> BlockRecord:
        return BlockRecord(block.key, block.parent_key, block.token_ids, self.model_identity, self.kv_dtype,
                           self.block_size, self.bytes_per_block, self.kv_layout, block.group)


@dataclass
class TierCounters:
    """Since start: tokens hit per tier (with KV cache groups, those of group 0's blocks), blocks, bytes and
    seconds moved each way, disk events."""

    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    blocks_offloaded: int = 0
    bytes_offloaded: int = 0
    offload_seconds: float = 0.0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    blocks_dropped: int = 0  # offloads skipped: every host row was pinned
    disk_writes: int = 0
    disk_write_errors: int = 0
    disk_reads: int = 0
    disk_read_seconds: float = 0.0
    disk_reads_skipped: int = 0  # blocks on the disk that were recomputed: reading measured slower
    corrupt_blocks: int = 0
    swap_seconds: float = 0.0  # copying swapped-out requests' KV out and back (``kv/swap.py``)


class HostTier:
    """Block-sized rows of one host tensor, keyed by content, least recently used first out. Pinned keys (a
    load planned, a write under way) are never evicted; a reserved row belongs to its reserver until it is
    published or released. Not thread-safe: ``TieredStore`` locks around it."""

    def __init__(self, num_rows: int, bytes_per_block: int, pin_memory: bool) -> None:
        self.slab = torch.empty((num_rows, bytes_per_block), dtype=torch.uint8, pin_memory=pin_memory)
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # key -> row, least recently used first
        self._free = list(range(num_rows - 1, -1, -1))
        self._pins: Counter[bytes] = Counter()
        self.from_disk: set[bytes] = set()  # prefetched, not yet loaded: a hit on them is a disk hit
        # blocks of KV cache groups 1.. (``kv/groups.py``): a hit on one adds no hit tokens, as the group-0 block of
        # the same tokens counts them (or they were a hit on the device)
        self.other_groups: set[bytes] = set()

    @property
    def num_rows(self) -> int:
        return self.slab.shape[0]

    @property
    def num_blocks(self) -> int:
        return len(self._rows)

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def row(self, key: bytes) -> int:
        """The key's row, now the most recently used."""
        self._rows.move_to_end(key)
        return self._rows[key]

    def reserve(self) -> int | None:
        """A row to fill: a free one, else the least recently used unpinned block's. None if all are pinned."""
        if self._free:
            return self._free.pop()
        victim = next((key for key in self._rows if not self._pins[key]), None)
        if victim is None:
            return None
        self.from_disk.discard(victim)
        self.other_groups.discard(victim)
        return self._rows.pop(victim)

    def num_unpinned_rows(self) -> int:
        """Rows free or holding a block that may be evicted: what reads can take."""
        return len(self._free) + sum(1 for key in self._rows if not self._pins[key])

    def hold(self, num_rows: int) -> list[int] | None:
        """``num_rows`` rows taken out of the tier for a caller to keep until it releases them (a swapped-out
        request's KV): free rows first, then the least recently used unpinned blocks'. All or nothing: None,
        taking none, if fewer rows than that are free or unpinned."""
        if len(self._free) < num_rows and self.num_unpinned_rows() < num_rows:
            return None
        rows = [self.reserve() for _ in range(num_rows)]
        assert None not in rows
        return rows

    def check_rows(self, held: list[int], num_reading: int) -> None:
        """Every row is free, indexed, held by a caller (``held``) or being read into; none is two of them."""
        free, indexed = set(self._free), set(self._rows.values())
        assert len(free) == len(self._free) and len(indexed) == len(self._rows), "a host row listed twice"
        assert len(set(held)) == len(held), f"a host row held twice: {sorted(held)}"
        assert not (free & set(held) or indexed & set(held)), "a held host row is also free or indexed"
        assert not free & indexed, "a host row is both free and indexed"
        assert self.other_groups <= self._rows.keys(), "a block of KV cache groups 1.. is marked but not held"
        num_accounted = len(free) + len(indexed) + len(held)
        assert num_accounted <= self.num_rows <= num_accounted + num_reading, (
            f"{len(free)} free + {len(indexed)} indexed + {len(held)} held host rows, {num_reading} being read: "
            f"{self.num_rows} rows in all"
        )

    def publish(self, key: bytes, row: int, group: int = 0) -> None:
        """A reserved row now holds ``key``'s block, of KV cache group ``group`` (a copy already held is
        replaced)."""
        if key in self._rows:
            self._free.append(self._rows.pop(key))
        self._rows[key] = row
        if group:
            self.other_groups.add(key)

    def release(self, row: int) -> None:
        self._free.append(row)

    def pin(self, key: bytes) -> None:
        self._pins[key] += 1

    def unpin(self, key: bytes) -> None:
        self._pins[key] -= 1
        if not self._pins[key]:
            del self._pins[key]


def _scandir_or_nothing(path: str) -> list[os.DirEntry]:
    """The entries of a subdirectory, or none if it cannot be listed (one bad entry spoils no tier)."""
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def _stat_or_none(entry: os.DirEntry) -> os.stat_result | None:
    """A regular file's stat; None for anything else, a dangling symlink or a file gone since the listing."""
    try:
        return entry.stat() if entry.is_file() else None
    except OSError:
        return None


# Write errors of the whole directory: after one, nothing more is written there. Any other error (a directory
# or a foreign entry where a block file would go) is that block's alone, which is then not written.
_DIRECTORY_WIDE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})


class IOThread:
    """One daemon thread running the calls submitted to it, in order. Not a ThreadPoolExecutor, whose threads
    the interpreter joins at exit: a read or write stuck in a hung filesystem would hold the process for good
    (the engine flushes queued writes for a bounded time before it closes the tiers)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        self._calls.put(functools.partial(fn, *args))

    def close(self, timeout: float) -> bool:
        """Stop once the calls queued so far are done; False if they are not done within ``timeout``."""
        self._calls.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call()
            except Exception:  # a call's own faults are handled in it: this is a bug, logged, not the thread's end
                logger.exception("%s: an I/O call failed", self.name)


class DiskTier:
    """The index of one directory of block files, oldest first, and the file I/O on it. The index methods are
    locked by ``TieredStore``; ``write`` and ``read`` run unlocked on its I/O threads."""

    def __init__(self, directory: str, capacity_bytes: int, block_format: BlockFormat) -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.format = block_format
        self.writable = True
        self._files: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._bad: set[bytes] = set()  # found corrupt or foreign: never read again unless rewritten
        self.num_bytes = 0
        try:
            os.makedirs(directory, exist_ok=True)
            self._scan()
        except OSError as error:
            self.writable = False
            logger.warning("KV disk tier: cannot use %s (%s); prefixes not in memory will be recomputed",
                           directory, error)

    def _scan(self) -> None:
        """Index the files already there (a predecessor's, or another server's), oldest first."""
        found = []
        for sub in os.scandir(self.directory):
            if sub.is_dir() and len(sub.name) == 2:
                for entry in _scandir_or_nothing(sub.path):
                    if entry.name.endswith(FILE_SUFFIX) and (stat := _stat_or_none(entry)) is not None:
                        found.append((stat.st_mtime, entry.name[: -len(FILE_SUFFIX)], stat.st_size))
        for _, name, size in sorted(found):
            try:
                self._files[bytes.fromhex(name)] = size
                self.num_bytes += size
            except ValueError:
                continue  # not a kvserve block file name

    def path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.directory, name[:2], name + FILE_SUFFIX)

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    def has(self, key: bytes) -> bool:
        """Whether a usable-looking file for ``key`` exists: indexed, or written since by another server."""
        if key in self._bad:
            return False
        return key in self._files or os.path.isfile(self.path(key))

    def indexed(self, key: bytes) -> bool:
        return key in self._files

    def add(self, key: bytes, size: int) -> list[bytes]:
        """Index a file just written; returns the keys to delete to keep within the capacity, oldest first."""
        self.num_bytes += size - self._files.pop(key, 0)
        self._files[key] = size
        self._bad.discard(key)
        victims = []
        while self.num_bytes > self.capacity_bytes and len(self._files) > 1:
            victim, victim_size = self._files.popitem(last=False)
            self.num_bytes -= victim_size
            victims.append(victim)
        return victims

    def touch(self, key: bytes) -> None:
        if key in self._files:
            self._files.move_to_end(key)

    def mark_bad(self, key: bytes) -> None:
        self._bad.add(key)
        self.num_bytes -= self._files.pop(key, 0)

    def is_directory(self) -> bool:
        """Whether the directory is still one: another process may delete it or put a file in its place."""
        return os.path.isdir(self.directory)

    def forget_all(self) -> int:
        """Drop the whole index (the directory is gone); returns how many blocks it held."""
        forgotten = len(self._files)
        self._files.clear()
        self.num_bytes = 0
        return forgotten

    def write(self, block: KeyedBlock, payload: memoryview) -> int:
        path = self.path(block.key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return write_block_file(path, self.format.record(block), payload)

    def read(self, block: KeyedBlock, out: memoryview) -> None:
        read_block_file(self.path(block.key), self.format.record(block), out)

    def remove(self, key: bytes) -> None:
        try:
            os.unlink(self.path(key))
        except OSError:
            pass  # gone already (another server trimmed it) or a read-only directory


class TieredStore:
    """The host and disk tiers behind one interface: the KV manager asks where a key is, prefetches disk hits
    and says which blocks to offload; the runner moves bytes with ``offload`` and ``load``."""

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
        self.disk = DiskTier(disk_dir, int(disk_bytes or 2**62), block_format) if disk_dir else None
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._io_done = threading.Condition(self._lock)
        self._reading: set[bytes] = set()
        self._writing: set[bytes] = set()
        self._reader = IOThread("kvserve-kv-read") if self.disk else None
        self._writer = IOThread("kvserve-kv-write") if self.disk else None

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
                    row = self.host.reserve()
                    if row is None:
                        break
                    self._reading.add(block.key)
                    self._reader.submit(self._read, block, row)
            num_started += 1
        return num_started

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
        """Keep these host blocks until ``load`` moves them (a load is planned); False, pinning none, if one
        left the host tier since it was located."""
        with self._lock:
            if not all(key in self.host for key in keys):
                return False
            for key in keys:
                self.host.pin(key)
            return True

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
        released) or being read into. Raises AssertionError."""
        with self._lock:
            self.host.check_rows(held_rows, len(self._reading))

    def wait_for_reads(self, timeout: float) -> None:
        """Block until no prefetch is under way, or ``timeout`` seconds (an idle engine waiting on the disk)."""
        with self._io_done:
            self._io_done.wait_for(lambda: not self._reading, timeout)

    @property
    def num_reading(self) -> int:
        with self._lock:
            return len(self._reading)

    # ----------------------------------------------------------------------------------- the runner's side

    def offload(self, kv: KVCacheStorage, blocks: Sequence[tuple[int, KeyedBlock]]) -> None:
        """Copy device blocks into host rows (before the forward pass may overwrite them), then queue the disk
        writes of those the disk lacks."""
        start = time.perf_counter()
        with self._lock:
            rows = [self.host.reserve() for _ in blocks]
        kept = [(block_id, block, row) for (block_id, block), row in zip(blocks, rows) if row is not None]
        kv.read_blocks([block_id for block_id, _, _ in kept], self.host.slab, [row for _, _, row in kept])
        writes = []
        with self._lock:
            for _, block, row in kept:
                self.host.publish(block.key, row, block.group)
                if self._should_write(block.key):
                    self._writing.add(block.key)
                    self.host.pin(block.key)
                    writes.append((block, row))
        for block, row in writes:
            assert self._writer is not None
            self._writer.submit(self._write, block, row)
        c = self.counters
        c.blocks_dropped += len(blocks) - len(kept)
        c.blocks_offloaded += len(kept)
        c.bytes_offloaded += len(kept) * self.format.bytes_per_block
        c.offload_seconds += time.perf_counter() - start

    def load(self, kv: KVCacheStorage, loads: Sequence[tuple[bytes, int]]) -> None:
        """Copy pinned host blocks into their device blocks ((key, block_id) pairs), then unpin them."""
        start = time.perf_counter()
        with self._lock:
            rows = [self.host.row(key) for key, _ in loads]
            for key, _ in loads:
                from_disk = key in self.host.from_disk
                self.host.from_disk.discard(key)
                num_tokens = 0 if key in self.host.other_groups else self.format.block_size
                if from_disk:
                    self.counters.disk_hit_tokens += num_tokens
                else:
                    self.counters.host_hit_tokens += num_tokens
                if self.disk is not None:
                    self.disk.touch(key)
        kv.write_blocks([block_id for _, block_id in loads], self.host.slab, rows)
        with self._lock:
            for key, _ in loads:
                self.host.unpin(key)
        c = self.counters
        c.blocks_loaded += len(loads)
        c.bytes_loaded += len(loads) * self.format.bytes_per_block
        c.load_seconds += time.perf_counter() - start

    def swap_out(self, kv: KVCacheStorage, moves: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks into the held host rows of a swapped-out request ((block_id, row) pairs)."""
        start = time.perf_counter()
        kv.read_blocks([block_id for block_id, _ in moves], self.host.slab, [row for _, row in moves])
        self.counters.swap_seconds += time.perf_counter() - start

    def swap_in(self, kv: KVCacheStorage, moves: Sequence[tuple[int, int]]) -> None:
        """Copy held host rows back into device blocks ((row, block_id) pairs) of a resumed request."""
        start = time.perf_counter()
        kv.write_blocks([block_id for _, block_id in moves], self.host.slab, [row for row, _ in moves])
        self.counters.swap_seconds += time.perf_counter() - start

    # ------------------------------------------------------------------------------------ the I/O threads

    def _should_write(self, key: bytes) -> bool:
        disk = self.disk
        return disk is not None and disk.writable and key not in self._writing and not disk.indexed(key)

    def _write(self, block: KeyedBlock, row: int) -> None:
        assert self.disk is not None
        try:
            size = self.disk.write(block, memoryview(self.host.slab[row].numpy()))
        except OSError as error:
            whole_directory = error.errno in _DIRECTORY_WIDE_ERRORS or not self.disk.is_directory()
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
                self.counters.disk_writes += 1
            for victim in victims:
                self.disk.remove(victim)
        finally:
            with self._io_done:
                self._writing.discard(block.key)
                self.host.unpin(block.key)
                self._io_done.notify_all()

    def _read(self, block: KeyedBlock, row: int) -> None:
        assert self.disk is not None
        start = time.perf_counter()
        try:
            self.disk.read(block, memoryview(self.host.slab[row].numpy()))
        except (OSError, CorruptBlockError) as error:
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
        """A block file that cannot be used: skipped, counted, logged, and removed if it is corrupt."""
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
            logger.warning("KV disk tier: skipping block file %s: %s", self.disk.path(key), error)
        if isinstance(error, CorruptBlockError):
            self.disk.remove(key)

    # -------------------------------------------------------------------------------------------- the rest

    def flush(self, timeout: float | None = None) -> None:
        """Block until every queued disk write and read is done (shutdown, tests)."""
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
            "kv_offload_seconds": c.offload_seconds,
            "kv_offload_bandwidth_gbps": _gbps(c.bytes_offloaded, c.offload_seconds),
            "kv_offload_blocks_loaded": c.blocks_loaded,
            "kv_offload_loaded_bytes": c.bytes_loaded,
            "kv_reload_seconds": c.load_seconds,
            "kv_reload_bandwidth_gbps": _gbps(c.bytes_loaded, c.load_seconds),
            "kv_offload_blocks_dropped": c.blocks_dropped,
            "kv_offload_disk_writes": c.disk_writes,
            "kv_offload_disk_write_errors": c.disk_write_errors,
            "kv_offload_disk_reads": c.disk_reads,
            "kv_offload_disk_read_bandwidth_gbps": _gbps(c.disk_reads * bytes_per_block, c.disk_read_seconds),
            "kv_offload_disk_reads_skipped": c.disk_reads_skipped,
            "kv_offload_corrupt_blocks": c.corrupt_blocks,
            "kv_swap_seconds": c.swap_seconds,
        }


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


_BUILD_KEYS = ("transformers_version",)  # which library wrote the configuration: not the model


def model_identity(named_tensors: Iterable[tuple[str, torch.Tensor]], extra: str, config: Mapping[str, Any]) -> str:
    """A fingerprint of a loaded model that a block written for another model cannot share: its configuration
    (``config``, the model's own: rope, norms and windows shape its KV as much as the weights do; keys that start
    with ``_`` name where it was loaded from, and are left out), every tensor's name, shape, dtype, first and last
    bytes and the sum of its words, and ``extra`` (the device, dtypes, weight format). The words are summed as
    integers (wrapping), so the sum does not depend on the thread count that computes it: two processes agree."""
    settings = {key: value for key, value in config.items() if not key.startswith("_") and key not in _BUILD_KEYS}
    digest = hashlib.blake2b(extra.encode(), digest_size=16)
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        flat = tensor.detach().reshape(-1)
        ends = torch.cat([flat[:32], flat[-32:]]).cpu().contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{_word_sum(flat)}|".encode())
        digest.update(ends.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _word_sum(flat: torch.Tensor) -> int:
    """The sum of a tensor's bytes read as int64 words (int32 words, or bytes, where its size or its offset in
    its storage is no multiple of 8)."""
    data = flat.contiguous().view(torch.uint8)
    for word in (torch.int64, torch.int32):
        if data.numel() % word.itemsize == 0 and data.storage_offset() % word.itemsize == 0:
            return int(data.view(word).sum(dtype=torch.int64))
    return int(data.sum(dtype=torch.int64))
