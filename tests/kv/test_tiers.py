"""The host and disk KV tiers: LRU with pins, bit-exact round trips through each tier, a restarted store
finding its predecessor's files, and every bad file or disk fault degrading with a count and a warning."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from kvserve.kv import disk_tier
from kvserve.kv.block_keys import KeyedBlock, block_key
from kvserve.kv.storage import KVCacheSpec, KVCacheStorage
from kvserve.kv.disk_tier import BlockFormat
from kvserve.kv.host_tier import HostTier
from kvserve.kv.tiers import Tier, TieredStore
from kvserve.worker.kv_transfers import HostCopies
from tests.sched.sched_fakes import load_now, offload_now

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
NUM_BLOCKS = 8


def _storage(seed: int = 0) -> KVCacheStorage:
    kv = KVCacheStorage(SPEC, NUM_BLOCKS, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for layer in range(SPEC.num_layers):
        k, v = (torch.randn(kv.num_slots, SPEC.num_kv_heads, SPEC.head_dim, generator=gen) for _ in "kv")
        kv.write(layer, torch.arange(kv.num_slots), k, v)
    return kv


def _store(host_blocks: int = 8, disk_dir: Path | None = None, identity: str = "model-a",
           disk_blocks: float | None = None, host_is_tier: bool = True) -> TieredStore:
    fmt = BlockFormat(identity, "float32", SPEC.block_size, SPEC.bytes_per_block)
    disk_bytes = None if disk_blocks is None else disk_blocks * (SPEC.bytes_per_block + 400)
    return TieredStore(fmt, host_blocks * SPEC.bytes_per_block, host_is_tier, str(disk_dir) if disk_dir else None,
                       disk_bytes)


def _chain(store: TieredStore, num_blocks: int) -> list[KeyedBlock]:
    """Content descriptions of a prefix of ``num_blocks`` blocks."""
    blocks, parent = [], store.root_key
    for index in range(num_blocks):
        tokens = tuple(range(index * 4, index * 4 + 4))
        key = block_key(parent, tokens)
        blocks.append(KeyedBlock(key, parent, tokens))
        parent = key
    return blocks


def _block_bytes(kv: KVCacheStorage, block_id: int) -> bytes:
    rows = torch.zeros(1, SPEC.bytes_per_block, dtype=torch.uint8)
    kv.read_blocks([block_id], rows, [0])
    return rows.numpy().tobytes()


def _load(store: TieredStore, kv: KVCacheStorage, pairs: list[tuple[bytes, int]]) -> None:
    assert store.pin([key for key, _ in pairs])
    load_now(store, kv, pairs)


def test_host_tier_evicts_the_least_recently_used_unpinned_block() -> None:
    host = HostTier(num_rows=2, bytes_per_block=4, pin_memory=False)
    for key in (b"a", b"b"):
        host.publish(key, host.reserve())
    host.row(b"a")  # a is now the most recently used
    host.publish(b"c", host.reserve())
    assert b"b" not in host and b"a" in host and b"c" in host
    host.pin(b"a")
    host.publish(b"d", host.reserve())  # c goes, a is pinned
    assert b"c" not in host and b"a" in host
    host.pin(b"d")
    assert host.reserve() is None  # every block pinned
    host.unpin(b"d")
    assert host.reserve() is not None


def test_offload_then_load_through_the_host_tier_is_bit_exact() -> None:
    store, source, target = _store(), _storage(0), _storage(1)
    blocks = _chain(store, 3)
    assert all(store.wants_offload(b.key, evicted=True) for b in blocks)
    offload_now(store, source, [(5, blocks[0]), (2, blocks[1]), (7, blocks[2])])
    assert [store.locate(b.key) for b in blocks] == [Tier.HOST] * 3
    assert not store.wants_offload(blocks[0].key, evicted=True)  # held already
    _load(store, target, [(blocks[0].key, 0), (blocks[2].key, 1)])
    assert _block_bytes(target, 0) == _block_bytes(source, 5)
    assert _block_bytes(target, 1) == _block_bytes(source, 7)
    stats = store.stats()
    assert stats["kv_offload_host_hit_tokens"] == 8 and stats["kv_offload_blocks_loaded"] == 2
    assert stats["kv_offload_host_blocks"] == 3 and stats["kv_offload_blocks_offloaded"] == 3


def test_pin_fails_for_a_block_that_left_the_host_tier() -> None:
    store, kv = _store(host_blocks=1), _storage()
    first, second = _chain(store, 2)
    offload_now(store, kv, [(0, first)])
    offload_now(store, kv, [(1, second)])  # the one host row now holds the second block
    assert not store.pin([first.key, second.key])
    assert store.pin([second.key])


def test_a_plans_offloads_never_take_the_row_one_of_its_loads_reads() -> None:
    """Rows are picked as a plan is taken, the offloads' first, while its loads' blocks are still pinned: the
    runner copies offloads first, and one into a load's row would overwrite the block before it loads."""
    store, source, target = _store(host_blocks=1), _storage(0), _storage(1)
    loaded, evicted = _chain(store, 2)
    offload_now(store, source, [(5, loaded)])
    assert store.pin([loaded.key])  # a load planned
    assert store.reserve_offload_rows([(6, evicted)]) == ()  # the one row is the load's: dropped
    HostCopies(store.host_slab).load(target, store.take_load_rows([(loaded.key, 0)]))
    assert _block_bytes(target, 0) == _block_bytes(source, 5)
    assert store.stats()["kv_offload_blocks_dropped"] == 1 and store.locate(loaded.key) is Tier.HOST


def test_a_blocks_disk_write_waits_for_its_copy_into_the_host_row(tmp_path: Path) -> None:
    """The writer thread reads an offload's host row, so its write is queued only once the runner has copied the
    block there (``HostCopies.after_offloads``: ``publish_offloads``); until then the row stays pinned, so no
    reservation takes it."""
    store, kv = _store(host_blocks=1, disk_dir=tmp_path), _storage()
    block = _chain(store, 1)[0]
    offloads = store.reserve_offload_rows([(3, block)])
    store.flush()  # waits for no write not yet queued
    assert not os.path.exists(store.disk.path(block.key)) and store.host.reserve() is None
    HostCopies(store.host_slab, store.publish_offloads).offload(kv, offloads)
    store.flush()
    restarted, target = _store(disk_dir=tmp_path), _storage(1)
    assert _prefetched(restarted, [block]) == [Tier.HOST]
    _load(restarted, target, [(block.key, 0)])
    assert _block_bytes(target, 0) == _block_bytes(kv, 3)


def test_an_offload_is_found_only_once_copied_and_one_never_copied_gives_its_row_back(tmp_path: Path) -> None:
    """A step that raises before its copies leaves no key over a row that was never written, nor a write of it."""
    store, kv = _store(host_blocks=2, disk_dir=tmp_path), _storage()
    first, second = _chain(store, 2)
    offloads = store.reserve_offload_rows([(3, first)])
    assert store.locate(first.key) is None and store.staging_rows() == 1  # reserved: neither found nor free
    store.check_integrity([])
    store.abandon_offloads()
    store.flush()
    assert store.locate(first.key) is None and store.staging_rows() == 2
    assert store.stats()["kv_offload_disk_writes"] == 0
    offloads = store.reserve_offload_rows([(3, first), (4, second)])
    HostCopies(store.host_slab, store.publish_offloads).offload(kv, offloads)
    store.flush()
    assert [store.locate(b.key) for b in (first, second)] == [Tier.HOST] * 2
    assert store.stats()["kv_offload_disk_writes"] == 2 and store.stats()["kv_offload_blocks_offloaded"] == 2
    store.check_integrity([])


def test_a_read_that_fails_unforeseen_skips_the_block_and_gives_its_row_back(tmp_path: Path, monkeypatch,
                                                                             caplog) -> None:
    first, kv = _store(disk_dir=tmp_path), _storage()
    blocks = _chain(first, 2)
    _write_through(first, kv, blocks)
    second = _store(host_blocks=2, disk_dir=tmp_path)
    monkeypatch.setattr(second.disk, "read", lambda block, out: [][0])  # a bug, say: IndexError
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        assert _prefetched(second, blocks) == [None, None]
    assert second.staging_rows() == 2 and "IndexError" in caplog.text
    second.check_integrity([])


def _write_through(store: TieredStore, kv: KVCacheStorage, blocks: list[KeyedBlock]) -> None:
    assert all(store.wants_offload(b.key, evicted=False) for b in blocks)
    offload_now(store, kv, list(enumerate(blocks)))
    store.flush()


def _prefetched(store: TieredStore, blocks: list[KeyedBlock]) -> list[Tier | None]:
    store.prefetch(blocks)
    store.flush()
    return [store.locate(b.key) for b in blocks]


def test_a_restarted_store_finds_its_predecessors_blocks_on_disk(tmp_path: Path) -> None:
    first, kv = _store(disk_dir=tmp_path), _storage(0)
    blocks = _chain(first, 3)
    _write_through(first, kv, blocks)
    assert first.stats()["kv_offload_disk_blocks"] == 3
    first.close()
    second, target = _store(disk_dir=tmp_path), _storage(1)
    assert second.stats()["kv_offload_disk_blocks"] == 3  # indexed at start
    assert [second.locate(b.key) for b in blocks] == [Tier.DISK] * 3
    assert not second.wants_offload(blocks[0].key, evicted=False)  # on disk already
    assert _prefetched(second, blocks) == [Tier.HOST] * 3
    _load(second, target, [(b.key, i + 4) for i, b in enumerate(blocks)])
    for i in range(3):
        assert _block_bytes(target, i + 4) == _block_bytes(kv, i)
    assert second.stats()["kv_offload_disk_hit_tokens"] == 12


def test_two_stores_share_one_directory(tmp_path: Path) -> None:
    writer, reader, kv = _store(disk_dir=tmp_path), _store(disk_dir=tmp_path), _storage()
    blocks = _chain(writer, 2)
    _write_through(writer, kv, blocks)
    assert [reader.locate(b.key) for b in blocks] == [Tier.DISK] * 2  # written after the reader started
    assert _prefetched(reader, blocks) == [Tier.HOST] * 2


def test_corrupt_and_truncated_files_are_skipped_counted_and_removed(tmp_path: Path, caplog) -> None:
    first, kv = _store(disk_dir=tmp_path), _storage()
    blocks = _chain(first, 2)
    _write_through(first, kv, blocks)
    paths = [first.disk.path(b.key) for b in blocks]
    data = bytearray(Path(paths[0]).read_bytes())
    data[-1] ^= 0xFF
    Path(paths[0]).write_bytes(bytes(data))
    Path(paths[1]).write_bytes(Path(paths[1]).read_bytes()[:-7])
    second = _store(disk_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        assert _prefetched(second, blocks) == [None, None]
    assert second.stats()["kv_offload_corrupt_blocks"] == 2
    assert "checksum" in caplog.text and "truncated" in caplog.text
    assert not any(os.path.exists(p) for p in paths)


def test_a_block_file_of_another_model_is_never_used(tmp_path: Path) -> None:
    theirs, kv = _store(disk_dir=tmp_path, identity="model-b"), _storage()
    their_block = _chain(theirs, 1)[0]
    _write_through(theirs, kv, [their_block])
    ours = _store(disk_dir=tmp_path)
    our_block = _chain(ours, 1)[0]  # the same tokens: another key, so no file at first
    assert ours.locate(our_block.key) is None
    os.makedirs(os.path.dirname(ours.disk.path(our_block.key)), exist_ok=True)
    shutil.copy(theirs.disk.path(their_block.key), ours.disk.path(our_block.key))  # planted under our key
    assert _prefetched(ours, [our_block]) == [None]
    assert ours.stats()["kv_offload_corrupt_blocks"] == 1


def test_a_full_disk_stops_writing_with_one_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier, "write_block_file", full)
    store, kv = _store(disk_dir=tmp_path), _storage()
    blocks = _chain(store, 3)
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        offload_now(store, kv, list(enumerate(blocks)))
        store.flush()
    assert caplog.text.count("no more blocks are written there") == 1
    assert "not written" not in caplog.text  # the writes queued behind the first failed alike: said once
    stats = store.stats()
    assert not stats["kv_offload_disk_writable"] and stats["kv_offload_disk_write_errors"] == 3
    assert not store.wants_offload(_chain(store, 4)[3].key, evicted=False)  # not tried again
    assert [store.locate(b.key) for b in blocks] == [Tier.HOST] * 3  # the host tier still serves them


def test_a_directory_replaced_by_a_file_stops_writing_with_one_warning(tmp_path: Path, caplog) -> None:
    """Another process deletes the directory and puts a file in its place: every write then fails with ENOTDIR,
    a per-path error, but the directory as a whole is gone, so writing stops with one warning."""
    directory = tmp_path / "kv"
    store, kv = _store(disk_dir=directory), _storage()
    blocks = _chain(store, 5)
    _write_through(store, kv, blocks[:2])
    shutil.rmtree(directory)
    directory.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        offload_now(store, kv, [(i + 2, b) for i, b in enumerate(blocks[2:])])
        store.flush()
    assert caplog.text.count("no more blocks are written there") == 1 and "not written" not in caplog.text
    stats = store.stats()
    assert not stats["kv_offload_disk_writable"] and stats["kv_offload_disk_write_errors"] == 3


def test_reads_from_a_directory_that_is_gone_forget_its_blocks_with_one_warning(tmp_path: Path, caplog) -> None:
    directory = tmp_path / "kv"
    first, kv = _store(disk_dir=directory), _storage()
    blocks = _chain(first, 3)
    _write_through(first, kv, blocks)
    second = _store(disk_dir=directory, host_blocks=8)
    assert second.stats()["kv_offload_disk_blocks"] == 3
    shutil.rmtree(directory)
    directory.write_text("not a directory")
    with caplog.at_level(logging.INFO, logger="kvserve.kv.tiers"):
        assert _prefetched(second, blocks) == [None] * 3
    assert caplog.text.count("is no longer a directory") == 1 and "skipping block file" not in caplog.text
    stats = second.stats()
    assert stats["kv_offload_disk_blocks"] == 0 and stats["kv_offload_disk_bytes"] == 0
    assert stats["kv_offload_corrupt_blocks"] == 0  # gone is not corrupt


def test_a_block_file_trimmed_by_another_server_is_recomputed_without_a_warning(tmp_path: Path, caplog) -> None:
    first, kv = _store(disk_dir=tmp_path), _storage()
    blocks = _chain(first, 2)
    _write_through(first, kv, blocks)
    second = _store(disk_dir=tmp_path)
    os.unlink(second.disk.path(blocks[1].key))  # the other server's capacity trimmed it
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        assert _prefetched(second, blocks) == [Tier.HOST, None]
    assert "kvserve" not in caplog.text and second.stats()["kv_offload_disk_blocks"] == 1


def test_an_unusable_directory_leaves_the_host_tier_working(tmp_path: Path, caplog) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        store = _store(disk_dir=not_a_dir / "blocks")
    assert "cannot use" in caplog.text
    kv = _storage()
    block = _chain(store, 1)[0]
    assert store.wants_offload(block.key, evicted=True) and not store.wants_offload(block.key, evicted=False)
    offload_now(store, kv, [(0, block)])
    assert store.locate(block.key) is Tier.HOST


def test_the_disk_tier_keeps_within_its_capacity_oldest_out(tmp_path: Path) -> None:
    store, kv = _store(disk_dir=tmp_path, disk_blocks=2), _storage()
    blocks = _chain(store, 4)
    for index, block in enumerate(blocks):
        _write_through(store, kv, [block])
    assert store.stats()["kv_offload_disk_blocks"] == 2
    assert [os.path.exists(store.disk.path(b.key)) for b in blocks] == [False, False, True, True]


def test_servers_sharing_a_directory_share_its_capacity_least_recently_used_out(tmp_path: Path) -> None:
    """Each server counted only its own writes, so N servers on one directory (``--data-parallel-size N``) filled it
    to N times ``--kv-offload-disk``. A file's time is its last write or use, so the least recently used go first,
    whichever server wrote them."""
    first, second, kv = _store(disk_dir=tmp_path, disk_blocks=4), _store(disk_dir=tmp_path, disk_blocks=4), _storage()
    blocks = _chain(first, 8)
    _write_through(first, kv, blocks[:4])
    _write_through(second, kv, blocks[4:7])  # each of its writes lists the directory: it holds 3 and 4, 5, 6
    assert _prefetched(second, [blocks[3]]) == [Tier.HOST]
    _load(second, _storage(1), [(blocks[3].key, 0)])  # a hit: block 3 is the most recently used now
    _write_through(second, kv, blocks[7:])
    assert [os.path.exists(first.disk.path(b.key)) for b in blocks] == [False] * 3 + [True, False, True, True, True]
    assert sum(f.stat().st_size for f in tmp_path.rglob("*.kvb")) <= second.disk.capacity_bytes


def test_a_staging_slab_keeps_evicted_blocks_only_when_the_disk_lacks_them(tmp_path: Path) -> None:
    store, kv = _store(host_blocks=1, disk_dir=tmp_path, host_is_tier=False), _storage()
    on_disk, not_on_disk, other = _chain(store, 3)
    _write_through(store, kv, [on_disk])
    _write_through(store, kv, [other])  # takes the one host row
    assert store.locate(on_disk.key) is Tier.DISK
    assert not store.wants_offload(on_disk.key, evicted=True)
    assert store.wants_offload(not_on_disk.key, evicted=True)


def test_a_fifo_at_a_blocks_path_is_skipped_without_holding_the_reader(tmp_path: Path) -> None:
    """A foreign entry that would block an open() (a FIFO; the same for a device) is never read as a block, and
    the blocks after it still come back from disk."""
    first, kv = _store(disk_dir=tmp_path), _storage()
    blocks = _chain(first, 2)
    _write_through(first, kv, blocks)
    os.unlink(first.disk.path(blocks[0].key))
    os.mkfifo(first.disk.path(blocks[0].key))
    second = _store(disk_dir=tmp_path)
    assert _prefetched(second, blocks) == [None, Tier.HOST]
    assert second.stats()["kv_offload_corrupt_blocks"] == 1
    second.close()


def test_an_entry_in_a_blocks_way_costs_that_block_alone(tmp_path: Path, caplog) -> None:
    """A directory where a block file would go fails that block's write (and a dangling symlink is not indexed):
    the tier stays writable for every other block."""
    store, kv = _store(disk_dir=tmp_path), _storage()
    blocks = _chain(store, 3)
    os.makedirs(store.disk.path(blocks[0].key))
    (tmp_path / "ab").mkdir()
    os.symlink(tmp_path / "nowhere", tmp_path / "ab" / ("ab" * 16 + ".kvb"))
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        restarted = _store(disk_dir=tmp_path)
        assert "cannot use" not in caplog.text
        _write_through(restarted, kv, blocks)
    stats = restarted.stats()
    assert stats["kv_offload_disk_writable"] and stats["kv_offload_disk_write_errors"] == 1
    assert stats["kv_offload_disk_blocks"] == 2 and "not written" in caplog.text


def test_closing_leaves_an_io_thread_stuck_in_a_hung_filesystem_behind(tmp_path: Path, caplog) -> None:
    """A read or write that never returns (a hung mount) holds neither ``close`` past its timeout nor the
    process at exit: the I/O threads are daemons, and the call left behind is warned of."""
    store = _store(disk_dir=tmp_path)
    hung = threading.Event()
    store._reader.submit(hung.wait)
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers"):
        started = time.monotonic()
        store.close(timeout=0.2)
    assert time.monotonic() - started < 2 and "kvserve-kv-read still waits" in caplog.text
    assert store._reader._thread.daemon
    hung.set()


def test_an_io_call_that_raises_is_logged_and_the_thread_goes_on(caplog) -> None:
    thread, done = disk_tier.IOThread("kvserve-test-io"), threading.Event()
    with caplog.at_level(logging.ERROR, logger="kvserve.kv.disk_tier"):
        thread.submit(lambda: 1 / 0)
        thread.submit(done.set)
        assert done.wait(5) and thread.close(5)
    assert "an I/O call failed" in caplog.text


def test_a_store_restarted_with_a_smaller_disk_budget_keeps_within_it(tmp_path: Path) -> None:
    """Trimmed as it starts, the oldest first: it stayed over budget (6x in the audit) until a block was
    written, which a server whose traffic all hits the cache never does."""
    first, kv = _store(disk_dir=tmp_path), _storage(0)
    blocks = _chain(first, 5)
    _write_through(first, kv, blocks)
    first.close()
    second = _store(disk_dir=tmp_path, disk_blocks=2)
    stats = second.stats()
    assert stats["kv_offload_disk_blocks"] == 2 and stats["kv_offload_disk_bytes"] <= stats[
        "kv_offload_disk_capacity_bytes"]
    # (the oldest go first, by their files' times, which one quick write may share)
    assert sorted(str(second.locate(b.key)) for b in blocks) == sorted([str(None)] * 3 + [str(Tier.DISK)] * 2)
    assert sum(1 for _ in tmp_path.rglob("*.kvb")) == 2


def test_a_restarted_store_removes_the_temporary_files_of_writers_that_died(tmp_path: Path, caplog) -> None:
    """A server killed mid-write leaves its temporary file outside the index and the budget; one a live writer may
    still be writing (another server's, just now) stays."""
    first, kv = _store(disk_dir=tmp_path), _storage(0)
    block = _chain(first, 1)[0]
    _write_through(first, kv, [block])
    first.close()
    path = first.disk.path(block.key)
    dead, writing = Path(f"{path}.999999.dead0000.tmp"), Path(f"{path}.999998.live0000.tmp")
    for temporary in (dead, writing):
        temporary.write_bytes(b"KVSBLK")
    an_hour_ago = time.time() - 3600
    os.utime(dead, (an_hour_ago, an_hour_ago))
    with caplog.at_level(logging.INFO, logger="kvserve.kv.disk_tier"):
        second = _store(disk_dir=tmp_path)
    assert not dead.exists() and writing.exists() and "removed 1 temporary block files" in caplog.text
    assert second.locate(block.key) is Tier.DISK


def test_a_disk_tier_smaller_than_one_block_is_refused(tmp_path: Path) -> None:
    """1e-10 GiB rounded to 0 bytes, which read as no bound at all; under one block it kept one file over it."""
    for disk_blocks in (0.0, 0.5):
        with pytest.raises(ValueError, match="the disk KV tier .* is smaller than one block .* raise kv_offload_disk"):
            _store(disk_dir=tmp_path, disk_blocks=disk_blocks)
    assert _store(disk_dir=tmp_path, disk_blocks=1).disk.capacity_bytes == SPEC.bytes_per_block + 400


def test_rows_staged_for_waiting_requests_are_taken_by_no_offload_or_read(tmp_path: Path) -> None:
    """A read staged for a waiting request, not yet loaded, was the least recently used row: the next plan's
    offloads (or another request's reads) evicted it, and the request read it again (wasted reads, varying with
    when the reader thread finished)."""
    first, kv = _store(disk_dir=tmp_path), _storage(0)
    blocks = _chain(first, 3)
    _write_through(first, kv, blocks)
    first.close()
    store = _store(host_blocks=2, disk_dir=tmp_path)
    assert _prefetched(store, blocks[:2]) == [Tier.HOST] * 2
    store.keep_staged(frozenset(b.key for b in blocks[:2]))
    others = _chain(_store(identity="model-b"), 2)
    assert store.reserve_offload_rows([(5, others[0])]) == ()  # dropped: every unpinned row is staged
    assert store.prefetch(blocks[2:]) == 0
    assert [store.locate(b.key) for b in blocks[:2]] == [Tier.HOST] * 2
    store.keep_staged(frozenset())  # the request loaded them, or left
    assert len(store.reserve_offload_rows([(5, others[0])])) == 1
