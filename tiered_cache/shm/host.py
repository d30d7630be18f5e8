"""Who may share memory with whom, and sealed memfd segments (one place for both)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
from pathlib import Path

# Not in Python's fcntl module yet (Linux 5.1+): no new writable mapping or write() of the
# segment, while the mapping its creator made before the seal stays writable.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def host_identity() -> str:
    """This machine's boot id and host name ('' where the boot id cannot be read: then no
    client ever takes a segment path for its own)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return f"{boot}/{socket.gethostname()}"


def sealed_segment(name: str, size: int, writers_only_me: bool = False) -> tuple[int, mmap.mmap]:
    """A memfd of `size` bytes, sealed against shrinking and growing (a reader's map must never
    fault: SIGBUS), mapped read-write here; returns (fd, map). `writers_only_me`: seal it against
    any later writer too (`F_SEAL_FUTURE_WRITE`), so that a process it is shared with cannot
    write it, this map excepted."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        segment = mmap.mmap(fd, size)
        _huge_pages(segment)
        if writers_only_me:
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            except OSError:
                segment.close()
                raise
    except BaseException:
        os.close(fd)
        raise
    return fd, segment


def map_read_only(path: str, size: int) -> tuple[mmap.mmap, int]:
    """Map the segment at `path` (a `/proc/<pid>/fd/<n>`) read-only; returns (map, inode).
    Raises ValueError when it is not `size` bytes or not sealed against shrinking (a segment that
    could shrink under the map would fault the reader instead of letting it read), OSError when
    it cannot be opened (another host, another user, the process gone)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        stat = os.fstat(fd)
        if stat.st_size != size:
            raise ValueError(f"{path} is not the {size}-byte segment named")
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise ValueError(f"{path} is not sealed against shrinking (F_SEAL_SHRINK)")
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        _huge_pages(mapped)
        return mapped, stat.st_ino
    finally:
        os.close(fd)


def _huge_pages(mapped: mmap.mmap) -> None:
    """Ask for huge pages where the kernel gives them to shared memory (`shmem_enabled`: advise):
    fewer TLB misses when a GiB is read in one go. A no-op elsewhere."""
    with contextlib.suppress(AttributeError, OSError):
        mapped.madvise(mmap.MADV_HUGEPAGE)


def still_open(path: str, inode: int) -> bool:
    """Whether the process that made the segment still holds it open at `path` (its
    `/proc/<pid>/fd` entry is gone the moment it exits)."""
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False
