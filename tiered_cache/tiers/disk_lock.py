"""The disk tier's one owner per folder: an exclusive `flock` on `<folder>/.lock`, held while the
`DiskTier` is open.

The kernel drops the lock when its holder closes it or dies (SIGKILL included), so a crash never
leaves a stale lock behind, as a PID file would. flock locks belong to an open file, not to a
process, so a second owner in the same process is refused too (on local filesystems; NFS emulates
flock with POSIX locks, which do not conflict within one process). The file's text names the
holder (pid, host, start time) for the error the next would-be owner gets. The file is never
removed: unlinking it would let two owners each lock a different file of the same name.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from tiered_cache.errors import TieredCacheError
from tiered_cache.tiers.disk_files import open_private

LOCK_NAME = ".lock"


class FolderInUseError(TieredCacheError):
    """Another owner (another process, or another tier object in this one) holds the folder."""

    def __init__(self, folder: Path, holder: dict[str, str]) -> None:
        self.folder = folder
        self.pid = int(holder["pid"]) if holder.get("pid", "").isdigit() else None
        who = f"pid {self.pid}" if self.pid is not None else "a process (its pid is not written yet)"
        if self.pid == os.getpid():
            who += " (this process: a DiskTier on this folder is still open)"
        where = f" on host {holder['host']}" if "host" in holder else ""
        since = f" since {holder['since']}" if "since" in holder else ""
        super().__init__(
            f"disk folder {folder} is in use: {who}{where} holds its lock {folder / LOCK_NAME}{since}. "
            f"One folder has one owner: stop that one first, or use another folder.")


class FolderLock:
    """Holds `<folder>/.lock` exclusively from construction until `release()`.
    Raises FolderInUseError when another owner holds it (never waits), OSError when the folder
    cannot be written."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_NAME
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = _parse(os.pread(fd, 4096, 0))
            finally:
                os.close(fd)
            raise FolderInUseError(folder, holder) from None
        except BaseException:
            os.close(fd)
            raise
        since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}\nhost {socket.gethostname()}\nsince {since}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only the next owner's error names no pid
        # A file object, so that an owner dropped without release() still lets go when collected.
        self._file = os.fdopen(fd, "r+b", buffering=0)

    @property
    def held(self) -> bool:
        return not self._file.closed

    def release(self) -> None:
        """Let go of the folder (idempotent). The text is cleared first: it names live holders only."""
        if self.held:
            try:
                os.ftruncate(self._file.fileno(), 0)
            finally:
                self._file.close()


def _parse(text: bytes) -> dict[str, str]:
    fields = (line.split(" ", 1) for line in text.decode(errors="replace").splitlines())
    return {f[0]: f[1] for f in fields if len(f) == 2}
