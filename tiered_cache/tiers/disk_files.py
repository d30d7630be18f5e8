"""The files of one disk-tier folder (disk.py): one file per page blob, named by its key.

Files and folders are their owner's alone, as KV pages are a tenant's data: folders are created
0700 and files 0600 whatever the process umask; a folder that already existed keeps its mode
(it is the operator's), only the levels created here are set.

Writes are atomic: a temporary file is written and fsynced, then renamed over the final name,
so a crash at any moment leaves whole blobs and stray temporaries only (`scan` removes them).
Every read is verified. `PageFiles` keeps no index and no counters: it says what it found
(`PageRead`), and the tier keeps the books.
"""

from __future__ import annotations

import enum
import os
import uuid
from pathlib import Path

from tiered_cache.model.spec import KVSpec
from tiered_cache.tiers.read_buffers import ReadBuffers
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

FOLDER_MODE = 0o700
FILE_MODE = 0o600
_TMP_SUFFIX = ".tmp"
_KEPT_BUFFERS = 16  # read buffers kept between reads: more than the threads that read at once


def make_private_folder(path: str | Path) -> Path:
    """Create `path` and any missing parents, each 0700 (chmod after mkdir: the umask cannot widen
    or narrow it). Returns the path. Raises OSError when it cannot be created."""
    path = Path(path)
    missing = []
    level = path
    while not level.exists():
        missing.append(level)
        if level.parent == level:
            break
        level = level.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=FOLDER_MODE)
        except FileExistsError:  # created beside us meanwhile: it is not ours to change
            continue
        os.chmod(folder, FOLDER_MODE)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a folder")
    return path


def open_private(path: str | Path, flags: int) -> int:
    """`os.open(path, flags | O_CLOEXEC, 0600)`; a file it creates is readable by its owner only."""
    return os.open(path, flags | os.O_CLOEXEC, FILE_MODE)


class PageRead(enum.Enum):
    """What reading one page file found."""

    ARRIVED = "arrived"
    MISSING = "missing"  # the file is gone (deleted behind the index's back)
    CORRUPT = "corrupt"  # truncated, padded, another page, or a checksum mismatch
    ERROR = "error"  # the read failed (I/O error, permissions)


class PageFiles:
    """The page files under the folder `root`, created (with its missing parents) if needed.
    Reads may run on several threads at once; a write or a delete is the caller's to order."""

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = make_private_folder(root)
        self.fsync = fsync
        self.buffers = ReadBuffers(_KEPT_BUFFERS)  # what a file is read through into strided pages

    def path(self, key: bytes) -> Path:
        """The file that holds (or would hold) `key`'s blob."""
        # One flat folder: a batch then needs a single folder fsync to make its renames durable
        # (sharding into 256 sub-folders cost a fsync per folder and a fifth of the write speed).
        return self.root / key.hex()

    # --- at start --------------------------------------------------------------------------------
    def scan(self) -> tuple[list[tuple[bytes, int]], int]:
        """The folder's intact page files as (key, size), oldest modification first, and how many
        damaged ones were deleted. Leftover temporaries are deleted; names that are not a page
        key (the lock file, anything else) are left alone."""
        found, damaged = [], 0
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
                if self._intact_size(file, st.st_size):
                    found.append((st.st_mtime_ns, key, st.st_size))
                else:  # truncated by a crash, padded, or of another blob format: a miss for good
                    damaged += 1
                    file.unlink(missing_ok=True)
        return [(key, size) for _, key, size in sorted(found)], damaged

    @staticmethod
    def _intact_size(file: Path, size: int) -> bool:
        """Whether the file is as long as its blob header says (reads the header only: a flipped
        byte inside is caught by the checksum on first read, not by reading every file here)."""
        try:
            with open(file, "rb") as f:
                return expected_blob_size(f.read(HEADER_BYTES)) == size
        except (OSError, BlobError):
            return False

    # --- reads -----------------------------------------------------------------------------------
    def read(self, key: bytes) -> tuple[PageRead, bytes | None]:
        """`key`'s blob, verified: (ARRIVED, blob), or what was found instead and None."""
        try:
            blob = self.path(key).read_bytes()
        except FileNotFoundError:
            return PageRead.MISSING, None
        except OSError:
            return PageRead.ERROR, None
        try:
            verify_blob(blob, key)
        except BlobError:
            return PageRead.CORRUPT, None
        return PageRead.ARRIVED, blob

    def read_into(self, key: bytes, size: int, dest: PageDest, spec: KVSpec) -> PageRead:
        """`key`'s page file of `size` bytes, verified, into `dest`, no blob in between.

        A raw blob into a contiguous destination (a staging row): header, payload and trailer
        read apart by one `os.preadv`, the payload straight into `dest`, the checksum computed
        where the bytes lie. Anything else (a page's strided blocks in a CPU pool, a compressed
        blob): the file into a reused buffer (`ReadBuffers`), which stays in cache, checked there,
        then one copy or decode into `dest` (a preadv scattered straight over a pool page's 64
        blocks is slower than this: docs/PERFORMANCE.md, "Issue 33, item 3")."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return PageRead.MISSING
        except OSError:
            return PageRead.ERROR
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
                scratch = self.buffers.take(size + 1)
                try:
                    got = os.preadv(fd, [scratch[:size + 1]], 0)
                    decode_into(scratch[:got], spec, key, dest)
                finally:
                    self.buffers.give_back(scratch)
            return PageRead.ARRIVED
        except BlobError:
            return PageRead.CORRUPT
        except OSError:
            return PageRead.ERROR
        finally:
            os.close(fd)

    # --- writes ----------------------------------------------------------------------------------
    def write(self, key: bytes, blob: bytes) -> None:
        """Write `key`'s blob atomically. Raises OSError; whatever fails (a full disk mid-write,
        fsync, close, rename), no temporary stays."""
        final = self.path(key)
        tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}"
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
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

    def sync_names(self) -> bool:
        """Make the renames so far durable (one fsync of the folder). False when that failed: the
        blobs are written; only their names may not survive a crash."""
        try:
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            return False
        return True

    def delete(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)
