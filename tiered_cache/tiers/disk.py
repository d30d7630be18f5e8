"""Disk tier: one file per page blob under a folder, a byte capacity, LRU eviction.

Writes are atomic: a temporary file is written and fsynced, then renamed over the final name,
so a crash at any moment leaves whole blobs and stray temporaries only (removed at start). The
index is rebuilt from the folder at start, oldest modification first. Every read is verified;
a truncated or corrupt file is a miss, counted, and deleted.
"""

from __future__ import annotations

import os
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from tiered_cache.model.units import parse_size
from tiered_cache.tiers.base import EvictCallback, TierStats, leading_run
from tiered_cache.tiers.codec import BlobError, verify_blob

_TMP_SUFFIX = ".tmp"


class DiskTier:
    name = "disk"

    def __init__(self, path: str | Path, capacity: int | str, on_evict: EvictCallback | None = None,
                 fsync: bool = True) -> None:
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = parse_size(capacity)
        self.fsync = fsync
        self.on_evict = on_evict
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recent first
        self.used = 0
        self._stats = TierStats(self.name, capacity_bytes=self.capacity)
        self._rebuild()

    def _path(self, key: bytes) -> Path:
        # One flat folder: a batch then needs a single folder fsync to make its renames durable
        # (sharding into 256 sub-folders cost a fsync per folder and a fifth of the write speed).
        return self.root / key.hex()

    def _rebuild(self) -> None:
        found = []
        for file in self.root.iterdir():
            if file.name.endswith(_TMP_SUFFIX):
                file.unlink(missing_ok=True)  # a write that never completed
                continue
            try:
                key = bytes.fromhex(file.name)
                st = file.stat()
            except (ValueError, OSError):
                continue
            if len(key) == 32 and file.is_file():
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.used += size
        self._evict_to(self.capacity)

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

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        stored = 0
        dirs: set[Path] = set()
        for key, blob in items:
            if key in self.index:
                self.index.move_to_end(key)
                continue
            if len(blob) > self.capacity:
                continue
            self._evict_to(self.capacity - len(blob))
            try:
                path = self._write(key, blob)
            except OSError:
                self._stats.errors += 1
                continue
            dirs.add(path.parent)
            self.index[key] = len(blob)
            self.used += len(blob)
            self._stats.bytes_in += len(blob)
            stored += 1
        if self.fsync:
            for folder in dirs:  # make the renames durable too, once per folder per batch
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        return stored

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._drop(key)

    def stats(self) -> TierStats:
        self._stats.pages = len(self.index)
        self._stats.used_bytes = self.used
        return self._stats

    # --- files -----------------------------------------------------------------------------------
    def _write(self, key: bytes, blob: bytes) -> Path:
        final = self._path(key)
        tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, final)
        return final

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
