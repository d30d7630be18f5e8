"""Disk tier: one file per page blob under a folder, a byte capacity, LRU eviction.

One owner per folder: the tier holds an exclusive lock on `<folder>/.lock` (folder_lock.py)
from construction to `close()`; a second tier on the folder, in this process or another, gets
FolderInUseError instead of deleting and evicting the first one's files under it.

Writes are atomic: a temporary file is written and fsynced, then renamed over the final name,
so a crash at any moment leaves whole blobs and stray temporaries only (removed at start). The
index is rebuilt from the folder at start, oldest modification first. Every read is verified;
a truncated or corrupt file is a miss, counted, and deleted.

A full filesystem (ENOSPC, EDQUOT: smaller than the capacity, or shared) does not stop new pages:
the least recent files make room for the rest of the batch and the write is tried once more; a
write that still fails is counted in `errors` and dropped, leaving no partial file.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from tiered_cache.model.spec import KVSpec
from tiered_cache.model.units import format_binary, parse_size
from tiered_cache.tiers.base import EvictCallback, TierStats, leading_run
from tiered_cache.tiers.folder_lock import LOCK_NAME, FolderLock
from tiered_cache.tiers.private import make_private_folder, open_private
from tiered_cache.wire.checksum import checker_threads
from tiered_cache.wire.codec import (
    HEADER_BYTES,
    BlobError,
    PageDest,
    check_raw_pieces,
    contiguous_dest,
    decode_into,
    expected_blob_size,
    raw_blob_size,
    raw_header_size,
    verify_blob,
)

log = logging.getLogger("tiered_cache.tiers.disk")

_TMP_SUFFIX = ".tmp"
_FULL = (errno.ENOSPC, errno.EDQUOT)  # the filesystem (or the user's quota) is full
# `get_into` reads pages on threads (`checker_threads`: half the cores, 2 to 8) once a call moves
# this many bytes: a read (the kernel's copy) and a checksum (crc32c) both let the GIL go, so as
# many pages go at once as there are threads.
_THREADED_BYTES = 4 << 20


class _Read(enum.Enum):
    """What reading one page file into its destination found."""

    ARRIVED = "arrived"
    MISSING = "missing"  # the file is gone (deleted behind the index's back)
    CORRUPT = "corrupt"  # truncated, padded, another page, or a checksum mismatch
    ERROR = "error"  # the read failed (I/O error, permissions)


class DiskTier:
    name = "disk"

    def __init__(self, path: str | Path, capacity: int | str, on_evict: EvictCallback | None = None,
                 fsync: bool = True) -> None:
        """Open (creating it if needed) and own the folder `path`: lock it, drop leftover
        temporaries, index its blobs. Raises FolderInUseError when another tier owns it, OSError
        when it cannot be created or written, ValueError for a bad capacity."""
        self.root = Path(path)
        self.capacity = parse_size(capacity)
        make_private_folder(self.root)
        self._lock = FolderLock(self.root)
        self.fsync = fsync
        self.on_evict = on_evict
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recent first
        self.used = 0
        self._stats = TierStats(self.name, capacity_bytes=self.capacity)
        self._readers: ThreadPoolExecutor | None = None  # get_into's, started on first use
        self._scratch = threading.local()  # a reused blob-sized buffer per reading thread
        try:
            self._rebuild()
        except BaseException:
            self._lock.release()
            raise

    def file_of(self, key: bytes) -> Path:
        """The file that holds (or would hold) `key`'s blob: for tools that read it raw (benches)."""
        return self._path(key)

    def _path(self, key: bytes) -> Path:
        # One flat folder: a batch then needs a single folder fsync to make its renames durable
        # (sharding into 256 sub-folders cost a fsync per folder and a fifth of the write speed).
        return self.root / key.hex()

    def _rebuild(self) -> None:
        found = []
        for file in self.root.iterdir():
            if file.name == LOCK_NAME:
                continue
            if file.name.endswith(_TMP_SUFFIX):
                file.unlink(missing_ok=True)  # a write that never completed
                continue
            try:
                key = bytes.fromhex(file.name)
                st = file.stat()
            except (ValueError, OSError):
                continue
            if len(key) == 32 and file.is_file():
                if self._intact_size(file, st.st_size):
                    found.append((st.st_mtime_ns, key, st.st_size))
                else:  # truncated by a crash, padded, or of another blob format: a miss for good
                    self._stats.corrupt += 1
                    file.unlink(missing_ok=True)
        for _, key, size in sorted(found):
            self.index[key] = size
            self.used += size
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

    @staticmethod
    def _intact_size(file: Path, size: int) -> bool:
        """Whether the file is as long as its blob header says (reads the header only: a flipped
        byte inside is caught by the checksum on first read, not by reading every file here)."""
        try:
            with open(file, "rb") as f:
                return expected_blob_size(f.read(HEADER_BYTES)) == size
        except (OSError, BlobError):
            return False

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
        no blob per page in between (`_read_into`), on several threads for a large call. Returns
        the stored size of each blob whose page arrived, 0 for a miss; a file that is corrupt (or
        not a page of `spec`) is a miss, counted and deleted, and its destination holds anything."""
        jobs = [i for i, key in enumerate(keys) if key in self.index]
        sizes = {i: self.index[keys[i]] for i in jobs}

        def read(i: int) -> _Read:
            return self._read_into(keys[i], sizes[i], dests[i], spec)

        if len(jobs) > 1 and sum(sizes.values()) >= _THREADED_BYTES:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(checker_threads(), thread_name_prefix="disk-tier-read")
            reads = [self._readers.submit(read, i) for i in jobs]
            wait(reads)  # every read done before any error surfaces: none writes into a page freed after
            found = [r.result() for r in reads]
        else:
            found = [read(i) for i in jobs]
        arrived = [0] * len(keys)
        for i, what in zip(jobs, found, strict=True):
            key = keys[i]
            if what is _Read.ARRIVED:
                arrived[i] = sizes[i]
                self.index.move_to_end(key)
                self._stats.bytes_out += sizes[i]
            elif what is _Read.MISSING:
                self._forget(key)
            elif what is _Read.CORRUPT:
                self._stats.corrupt += 1
                self._drop(key)
            else:
                self._stats.errors += 1
        self._stats.hits += sum(1 for n in arrived if n)
        self._stats.misses += sum(1 for n in arrived if not n)
        return arrived

    def _read_into(self, key: bytes, size: int, dest: PageDest, spec: KVSpec) -> _Read:
        """One page file into `dest` (on a reader thread: touches no index or counter).

        A raw blob into a contiguous destination (a staging row): header, payload and trailer
        read apart by one `os.preadv`, the payload straight into `dest`, the checksum computed
        where the bytes lie. Anything else (a page's strided blocks in a CPU pool, a compressed
        blob): the file into this thread's reused buffer, which stays in cache, checked there,
        then one copy or decode into `dest` (a preadv scattered straight over a pool page's 64
        blocks is slower than this: docs/PERFORMANCE.md, "Issue 33, item 3")."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return _Read.MISSING
        except OSError:
            return _Read.ERROR
        try:
            flat = contiguous_dest(dest)
            if size == raw_blob_size(spec) and flat is not None:
                header, trailer = bytearray(raw_header_size(spec)), bytearray(4)
                # One byte past the blob: a padded file reads it, and is refused as a whole read would be.
                got = os.preadv(fd, [header, flat, trailer, bytearray(1)], 0)
                if got != size:
                    raise BlobError(f"page file holds {got} bytes, expected {size}")
                check_raw_pieces(header, flat, trailer, spec, key)
            else:
                scratch = self._scratch_for(size + 1)
                got = os.preadv(fd, [scratch[:size + 1]], 0)
                decode_into(scratch[:got], spec, key, dest)
            return _Read.ARRIVED
        except BlobError:
            return _Read.CORRUPT
        except OSError:
            return _Read.ERROR
        finally:
            os.close(fd)

    def _scratch_for(self, nbytes: int) -> memoryview:
        """This thread's reused buffer, at least `nbytes` long (kept, so it is touched once)."""
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = self._scratch.buffer = memoryview(bytearray(nbytes))
        return buffer

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
            self.used += len(blob)
            self._stats.bytes_in += len(blob)
            stored += 1
        if stored and self.fsync:
            self._fsync_folder()  # make the renames durable too, once per batch
        return stored

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._drop(key)

    def stats(self) -> TierStats:
        self._stats.pages = len(self.index)
        self._stats.used_bytes = self.used
        return self._stats

    def close(self) -> None:
        """Give up the folder (idempotent): another tier may own it now. Its files stay for the
        next owner; this tier must not be used after."""
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None
        self._lock.release()

    # --- files -----------------------------------------------------------------------------------
    def _store(self, key: bytes, blob: bytes, room: int) -> bool:
        """Write one blob. On a full filesystem, evict least recent files for `room` bytes and try
        once more; a write that still fails is counted and dropped (never raised)."""
        try:
            self._write(key, blob)
            return True
        except OSError as exc:
            full = exc.errno in _FULL
        if full and self.index:
            self._evict_to(self.used - room)
            try:
                self._write(key, blob)
                return True
            except OSError:
                pass
        self._stats.errors += 1
        return False

    def _write(self, key: bytes, blob: bytes) -> None:
        final = self._path(key)
        tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}"
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:  # whatever fails (a full disk mid-write, fsync, close, rename), no temporary stays
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _fsync_folder(self) -> None:
        try:
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            self._stats.errors += 1  # the blobs are written; only their names may not survive a crash

    def _read(self, key: bytes) -> bytes | None:
        try:
            blob = self._path(key).read_bytes()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError:
            self._stats.errors += 1
            return None
        try:
            verify_blob(blob, key)
        except BlobError:
            self._stats.corrupt += 1
            self._drop(key)
            return None
        return blob

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
        self._path(key).unlink(missing_ok=True)
