"""Disk tier: one file per page blob under a folder, a byte capacity, LRU eviction.

One owner per folder: the tier holds an exclusive lock on `<folder>/.lock` (disk_lock.py)
from construction to `close()`; a second tier on the folder, in this process or another, gets
FolderInUseError instead of deleting and evicting the first one's files under it.

The files themselves (disk_files.py: owner-only, atomic writes, verified reads) are written so
that a crash at any moment leaves whole blobs and stray temporaries only (removed at start). The
index is rebuilt from the folder at start, oldest modification first. Every read is verified;
a truncated or corrupt file is a miss, counted, and deleted.

A full filesystem (ENOSPC, EDQUOT: smaller than the capacity, or shared) does not stop new pages:
the least recent files make room for the rest of the batch and the write is tried once more; a
write that still fails is counted in `errors` and dropped, leaving no partial file.
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from tiered_cache.model.spec import KVSpec
from tiered_cache.model.units import format_binary, parse_size
from tiered_cache.tiers.base import EvictCallback, Tier, TierStats, leading_run
from tiered_cache.tiers.disk_files import PageFiles, PageRead
from tiered_cache.tiers.disk_lock import FolderLock
from tiered_cache.wire.checksum import checker_threads
from tiered_cache.wire.codec import PageDest

log = logging.getLogger("tiered_cache.tiers.disk")

_FULL = (errno.ENOSPC, errno.EDQUOT)  # the filesystem (or the user's quota) is full
# `get_into` reads pages on threads (`checker_threads`: half the cores, 2 to 8) once a call moves
# this many bytes: a read (the kernel's copy) and a checksum (crc32c) both let the GIL go, so as
# many pages go at once as there are threads.
_THREADED_BYTES = 4 << 20


class DiskTier:
    name = Tier.DISK.value

    def __init__(self, path: str | Path, capacity: int | str, on_evict: EvictCallback | None = None,
                 fsync: bool = True) -> None:
        """Open (creating it if needed) and own the folder `path`: lock it, drop leftover
        temporaries, index its blobs. Raises FolderInUseError when another tier owns it, OSError
        when it cannot be created or written, ValueError for a bad capacity."""
        self.root = Path(path)
        self.capacity = parse_size(capacity)
        self.files = PageFiles(self.root, fsync)
        self._lock = FolderLock(self.root)
        self.on_evict = on_evict
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recent first
        self.used = 0
        self.largest = 0  # the largest file indexed since start: what a read buffer is made for
        self._stats = TierStats(self.name, capacity_bytes=self.capacity)
        self._readers: ThreadPoolExecutor | None = None  # get_into's, started by `warm` or on first use
        self._start_lock = threading.Lock()
        self._closed = False
        try:
            self._rebuild()
        except BaseException:
            self._lock.release()
            raise

    def file_of(self, key: bytes) -> Path:
        """The file that holds (or would hold) `key`'s blob: for tools that read it raw (benches)."""
        return self.files.path(key)

    def _rebuild(self) -> None:
        found, damaged = self.files.scan()
        self._stats.corrupt += damaged
        for key, size in found:
            self.index[key] = size
            self.used += size
            self.largest = max(self.largest, size)
        self._bound_by_filesystem()
        self._evict_to(self.capacity)

    def _bound_by_filesystem(self) -> None:
        """A filesystem with less room than the capacity would make the tier evict on ENOSPC with
        no word: the capacity becomes what fits (its blobs plus the free space), said once."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return
        room = self.used + free
        if room < self.capacity:
            log.warning("disk tier %s: the filesystem has room for %s, less than its capacity of %s; "
                        "using %s", self.root, format_binary(room), format_binary(self.capacity), format_binary(room))
            self.capacity = room
            self._stats.capacity_bytes = room

    # --- interface -------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self.index for key in keys]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return leading_run(key in self.index for key in keys)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out = [self._read(key) if key in self.index else None for key in keys]
        for key, blob in zip(keys, out, strict=True):
            if blob is not None:  # a bad file was dropped from the index by _read
                self.index.move_to_end(key)
        self._stats.record_reads(out)
        return out

    def get_into(self, keys: Sequence[bytes], dests: Sequence[PageDest], spec: KVSpec) -> list[int]:
        """Read each key's page of `spec`, verified, into `dests[i]` (codec.py's destinations),
        no blob per page in between (`PageFiles.read_into`), on several threads for a large call.
        Returns the stored size of each blob whose page arrived, 0 for a miss; a file that is
        corrupt (or not a page of `spec`) is a miss, counted and deleted, and its destination
        holds anything."""
        jobs = [i for i, key in enumerate(keys) if key in self.index]
        sizes = {i: self.index[keys[i]] for i in jobs}

        def read(i: int) -> PageRead:  # on a reader thread: touches no index or counter
            return self.files.read_into(keys[i], sizes[i], dests[i], spec)

        if len(jobs) > 1 and sum(sizes.values()) >= _THREADED_BYTES:
            reads = [self._reader_threads().submit(read, i) for i in jobs]
            wait(reads)  # every read done before any error surfaces: none writes into a page freed after
            found = [r.result() for r in reads]
        else:
            found = [read(i) for i in jobs]
        arrived = [0] * len(keys)
        for i, what in zip(jobs, found, strict=True):
            if what is PageRead.ARRIVED:
                arrived[i] = sizes[i]
                self.index.move_to_end(keys[i])
                self._stats.bytes_out += sizes[i]
            else:
                self._settle(keys[i], what)
        self._stats.hits += sum(1 for n in arrived if n)
        self._stats.misses += sum(1 for n in arrived if not n)
        return arrived

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        stored = 0
        pending = sum(len(blob) for _, blob in items)  # bytes of the batch from this blob on
        for key, blob in items:
            # What a full filesystem gets freed: the rest of the batch (so it meets a full disk once,
            # not once per blob) and one blob more, as files take whole blocks.
            room = pending + len(blob)
            pending -= len(blob)
            if key in self.index:
                self.index.move_to_end(key)
                continue
            if len(blob) > self.capacity:
                continue
            self._evict_to(self.capacity - len(blob))
            if not self._store(key, blob, room):
                continue
            self.index[key] = len(blob)
            self.largest = max(self.largest, len(blob))
            self.used += len(blob)
            self._stats.bytes_in += len(blob)
            stored += 1
        if stored and self.files.fsync and not self.files.sync_names():  # once per batch
            self._stats.errors += 1  # the blobs are written; only their names may not survive a crash
        return stored

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._drop(key)

    def stats(self) -> TierStats:
        self._stats.pages = len(self.index)
        self._stats.used_bytes = self.used
        return self._stats

    def warm(self) -> None:
        """Start the reader threads now, not on the first large read, and make the buffers page
        files are read through (one per reader thread and one for a caller reading a small call
        itself), as large as the largest file here."""
        readers = self._reader_threads()
        wait([readers.submit(time.sleep, 0.01) for _ in range(checker_threads())])
        if self.largest:
            self.files.buffers.make(checker_threads() + 1, self.largest + 1)  # + 1: a read asks one byte past

    def _reader_threads(self) -> ThreadPoolExecutor:
        with self._start_lock:
            if self._readers is None:
                if self._closed:
                    raise ValueError(f"the disk tier at {self.root} is closed")
                self._readers = ThreadPoolExecutor(checker_threads(), thread_name_prefix="disk-tier-read")
            return self._readers

    def close(self) -> None:
        """Give up the folder (idempotent): another tier may own it now. Its files stay for the
        next owner; this tier must not be used after."""
        with self._start_lock:
            self._closed = True
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=True)
        self._lock.release()

    # --- the books -------------------------------------------------------------------------------
    def _store(self, key: bytes, blob: bytes, room: int) -> bool:
        """Write one blob. On a full filesystem, evict least recent files for `room` bytes and try
        once more; a write that still fails is counted and dropped (never raised)."""
        try:
            self.files.write(key, blob)
            return True
        except OSError as exc:
            full = exc.errno in _FULL
        if full and self.index:
            self._evict_to(self.used - room)
            try:
                self.files.write(key, blob)
                return True
            except OSError:
                pass
        self._stats.errors += 1
        return False

    def _read(self, key: bytes) -> bytes | None:
        what, blob = self.files.read(key)
        if what is not PageRead.ARRIVED:
            self._settle(key, what)
        return blob

    def _settle(self, key: bytes, what: PageRead) -> None:
        """A read of `key` that did not arrive: a missing file is forgotten, a corrupt one counted
        and deleted, a failed read counted."""
        if what is PageRead.MISSING:
            self._forget(key)
        elif what is PageRead.CORRUPT:
            self._stats.corrupt += 1
            self._drop(key)
        elif what is PageRead.ERROR:
            self._stats.errors += 1

    def _evict_to(self, limit: int) -> None:
        while self.used > limit and self.index:
            key = next(iter(self.index))
            blob = self._read(key) if self.on_evict else None
            if key in self.index:
                self._drop(key)
                self._stats.evictions += 1
            if blob is not None and self.on_evict:
                self.on_evict([(key, blob)])

    def _forget(self, key: bytes) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.used -= size

    def _drop(self, key: bytes) -> None:
        self._forget(key)
        self.files.delete(key)
