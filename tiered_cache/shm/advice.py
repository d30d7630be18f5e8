"""madvise for memory this process maps, and faulting a shared segment in off the request path.

The first write to a fresh OS page costs a fault and the kernel zeroing it, several times slower
than a copy. A store server's arena (and a client's put ring) is written in order as blobs
arrive; `Prefault` keeps the memory just past the write head faulted in, so a Put copies into
memory that is already there, as it would once the log had come round once, while memory not
yet needed stays uncommitted. MADV_POPULATE_WRITE (Linux 5.14+) maps the pages without changing
a byte, so the owner may write meanwhile; where the kernel lacks it nothing is faulted in early.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

MADV_HUGEPAGE = 14  # Linux: back the range with transparent huge pages where possible
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in as if written, changing no byte
_OS_PAGE = mmap.PAGESIZE
_CHUNK_BYTES = 16 * 2**20
_IDLE_CHECK_S = 1.0  # an idle thread looks this often whether its owner is gone
AHEAD_BYTES = 256 * 2**20  # at most: a few Puts' worth of 8B-model pages, used soon

_LIBC: ctypes.CDLL | None = None


def madvise(address: int, length: int, advice: int) -> bool:
    """madvise over the OS pages of [address, address + length) (the GIL let go meanwhile:
    ctypes); False where it is refused or there is no madvise (not Linux)."""
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    first = address - address % _OS_PAGE
    return _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(address + length - first), advice) == 0


def populate(address: int, length: int) -> bool:
    """MADV_POPULATE_WRITE over [address, address + length); False when the platform lacks it
    (not Linux, a kernel before 5.14) or refuses."""
    return madvise(address, length, MADV_POPULATE_WRITE)


def map_address(mapped: mmap.mmap) -> int:
    """Where a writable map starts in this process (no export of it is left open)."""
    anchor = ctypes.c_char.from_buffer(mapped)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


class Prefault(threading.Thread):
    """A daemon thread keeping up to `ahead` bytes of a writable map faulted in past where its
    `owner` writes next (`written(owner)`: the owner writes in order, as a log does), changing no
    byte. The owner calls `nudge()` after it writes; the thread ends once the whole map is in,
    once the owner is gone (held weakly: this thread never keeps it, or its map, alive), or at
    `stop()` (before the map is closed: it waits for the chunk under way). Only memory about to
    be used is committed, and on a machine with a core to spare the kernel's zeroing runs beside
    the owner's copies instead of inside them."""

    def __init__(self, mapped: mmap.mmap, owner: object, written: Callable[[Any], int], ahead: int | None = None,
                 chunk_bytes: int = _CHUNK_BYTES) -> None:
        super().__init__(name="tiered-cache-prefault", daemon=True)
        self._address, self._length = map_address(mapped), len(mapped)
        # Held weakly and taken for each chunk: madvise never runs on a range unmapped meanwhile
        # (an address reused by another map would be faulted in: no byte changed, but memory spent).
        self._mapped = weakref.ref(mapped)
        self._owner = weakref.ref(owner)
        self._written = written
        # A sixteenth of the map, 16 to 256 MiB: a small arena or ring commits little ahead of use.
        self._ahead = ahead if ahead is not None else min(AHEAD_BYTES, max(_CHUNK_BYTES, self._length // 16))
        self._chunk = max(_OS_PAGE, chunk_bytes // _OS_PAGE * _OS_PAGE)
        self._wake = threading.Event()
        self._stopping = False
        self.faulted = 0  # the map is faulted in below this offset (by this thread or its owner)

    def _written_now(self) -> int | None:
        """Where the owner's writes have reached, or None once it is gone."""
        owner = self._owner()
        return None if owner is None else self._written(owner)

    def nudge(self) -> None:
        self._wake.set()

    def run(self) -> None:
        while not self._stopping and self.faulted < self._length:
            if not self._wake.wait(_IDLE_CHECK_S):  # not nudged: no write since, nothing to fault in
                if self._owner() is None:
                    return
                continue
            self._wake.clear()
            while not self._stopping:
                written = self._written_now()
                if written is None:
                    return
                written = written // _OS_PAGE * _OS_PAGE
                start = max(self.faulted, written)
                stop = min(written + self._ahead, self._length, start + self._chunk)
                if start >= stop:
                    self.faulted = start
                    break
                mapped = self._mapped()
                if mapped is None or mapped.closed:
                    return
                offered = populate(self._address + start, stop - start)
                del mapped
                if not offered:
                    return  # not offered here: pages fault in on first write, as without this thread
                self.faulted = stop

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self.is_alive():
            self.join()


def prefault_async(mapped: mmap.mmap, owner: object, written: Callable[[Any], int],
                   ahead: int | None = None) -> Prefault:
    """Start keeping `mapped` faulted in ahead of `written(owner)` on a daemon thread (`Prefault`)."""
    thread = Prefault(mapped, owner, written, ahead)
    thread.start()
    return thread


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC
