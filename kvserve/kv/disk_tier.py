"""The disk tier's files: one file a block in a directory (``block_file``'s format), its index, and the I/O
threads that read and write them off the step's critical path (``kv/tiers.py`` is the store over it)."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Collection

from kvserve.kv.block_file import TEMP_SUFFIX, BlockRecord, read_block_file, write_block_file
from kvserve.kv.block_keys import KeyedBlock

logger = logging.getLogger(__name__)

FILE_SUFFIX = ".kvb"
STALE_TEMP_SECONDS = 60.0  # a temporary block file this old is a dead writer's (a block is written in milliseconds)
# Servers sharing a directory share its capacity: each keeps its own index within it, and lists the directory again
# (the others' writes count too) and trims it once it has written this share of the capacity since its last listing.
# So the directory holds at most the capacity plus this share of it for each other server writing there.
LIST_EVERY_SHARE = 0.1


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


def list_directory(directory: str) -> tuple[list[tuple[bytes, int]], list[str]]:
    """The block files of a tier's directory ((key, size), least recently used first: a file's time is its last
    write or use), and the temporary files of writers that died mid-write (older than ``STALE_TEMP_SECONDS``).
    Raises OSError if the directory cannot be listed."""
    found, stale = [], []
    now = time.time()
    for sub in os.scandir(directory):
        if sub.is_dir() and len(sub.name) == 2:
            for entry in _scandir_or_nothing(sub.path):
                if (stat := _stat_or_none(entry)) is None:
                    continue
                if entry.name.endswith(FILE_SUFFIX):
                    with contextlib.suppress(ValueError):  # not a kvserve block file's name
                        found.append((stat.st_mtime, bytes.fromhex(entry.name[: -len(FILE_SUFFIX)]), stat.st_size))
                elif entry.name.endswith(TEMP_SUFFIX) and now - stat.st_mtime > STALE_TEMP_SECONDS:
                    stale.append(entry.path)
    return [(key, size) for _, key, size in sorted(found)], stale


def _remove_stale_temporaries(directory: str, paths: list[str]) -> None:
    """Temporary files of writers that died: outside every index and budget, nothing else would remove them."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):  # another server starting on the directory took it first
            os.unlink(path)
    if paths:
        logger.info("KV disk tier: removed %d temporary block files of %s left by writers that died", len(paths),
                    directory)


# Write errors of the whole directory: after one, nothing more is written there. Any other error (a directory
# or a foreign entry where a block file would go) is that block's alone, which is then not written.
DIRECTORY_WIDE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})


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
        self.stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop once the calls queued so far are done, without waiting."""
        self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                call()
            except Exception:  # a call's own faults are handled in it: this is a bug, logged, not the thread's end
                logger.exception("%s: an I/O call failed", self.name)
            del call  # it holds its store: kept while waiting for the next call, it kept a dropped store alive


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
        self._bytes_since_listing = 0  # written by this server since the directory was last listed
        try:
            os.makedirs(directory, exist_ok=True)
            files, stale = list_directory(directory)
            _remove_stale_temporaries(directory, stale)
            over = self.trim(files)  # a predecessor's blocks past this server's (smaller) budget
            for key in over:
                self.remove(key)
            if over:
                logger.info("KV disk tier: removed the %d oldest blocks of %s, over its %d bytes", len(over),
                            directory, capacity_bytes)
        except OSError as error:
            self.writable = False
            logger.warning("KV disk tier: cannot use %s (%s); prefixes not in memory will be recomputed",
                           directory, error)

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
        """Index a file just written; returns the keys to delete to keep the index within the capacity, least
        recently used first. Once ``listing_due``, the caller lists the directory (``list_directory``, unlocked)
        and has it trimmed (``trim``)."""
        self.num_bytes += size - self._files.pop(key, 0)
        self._files[key] = size
        self._bad.discard(key)
        self._bytes_since_listing += size
        return self._over_capacity(keep=key)

    @property
    def listing_due(self) -> bool:
        """Whether this server has written ``LIST_EVERY_SHARE`` of the capacity since it last listed the directory."""
        return self._bytes_since_listing >= LIST_EVERY_SHARE * self.capacity_bytes

    def trim(self, files: list[tuple[bytes, int]], keep: bytes | None = None) -> list[bytes]:
        """Index the directory as listed, every server's files, least recently used first (the capacity is the
        directory's, not this server's writes'), and drop the oldest but ``keep`` while it is over the capacity;
        returns their keys, for the caller to delete."""
        self._files = OrderedDict((key, size) for key, size in files if key not in self._bad)
        self.num_bytes = sum(self._files.values())
        self._bytes_since_listing = 0
        return self._over_capacity(keep)

    def _over_capacity(self, keep: bytes | None) -> list[bytes]:
        """Drop the least recently used files but ``keep`` from the index while it is over the capacity; returns
        their keys."""
        excess, victims = self.num_bytes - self.capacity_bytes, []
        for key, size in self._files.items():  # the oldest first, and no further: a copy of the whole index for
            if excess <= 0:                     # each file written cost ms at 10^4 files, under the store's lock
                break
            if key != keep:
                victims.append(key)
                excess -= size
        for key in victims:
            self.num_bytes -= self._files.pop(key)
        return victims

    def touch(self, key: bytes) -> None:
        """A hit on ``key``'s file: the most recently used in the index now, and on the disk (``mark_used``)."""
        if key in self._files:
            self._files.move_to_end(key)

    def mark_used(self, key: bytes) -> None:
        """The file's time is its last use, so that every server sharing the directory trims the least recently
        used first. An I/O call: run it on an I/O thread."""
        with contextlib.suppress(OSError):  # gone, or a read-only directory: its order is a hint only
            os.utime(self.path(key))

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

    def drop_index(self, keep: Collection[bytes]) -> list[bytes]:
        """Take every indexed file but those in ``keep`` out of the index; returns their keys, for the caller to
        delete."""
        victims = [key for key in self._files if key not in keep]
        for key in victims:
            self.num_bytes -= self._files.pop(key)
        return victims

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
