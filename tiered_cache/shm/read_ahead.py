"""`ReadAhead`: keeps a client's read-only map of a store server's arena faulted in as far as the
server has written, on a daemon thread.

A fresh map has no page-table entries: the first read of each 4 KiB page is a fault, so a new
reader's first load from the arena ran several times slower than its next ones, and every prefix
written since was slow again when first read. MADV_POPULATE_READ (Linux 5.14+) maps what the
server has written, reading no byte and committing nothing it has not (only written ranges are
asked for); without it pages fault in on first read, as before. What was written before the map
was made is mapped newest first (a new reader is likeliest to ask for what was written last),
new writes as they come.
"""

from __future__ import annotations

import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

from tiered_cache.shm.advice import madvise

MADV_POPULATE_READ = 22  # Linux 5.14+: fault pages in as if read
# A chunk bounds how long the thread holds a core while a request runs: mapping 4 KiB pages of a
# shared map one by one is slow where the VM's faults are (tens of ms per 16 MiB beside a load).
_CHUNK_BYTES = 4 * 2**20
_POLL_S = 0.02  # how often the server's head is looked at
# Called before each chunk by every read-ahead of the process: the cache sets it to wait (briefly)
# while any of the process's requests runs (cache/warm_up.py), as its other warm-up work does.
step_aside: Callable[[], object] | None = None


class ReadAhead(threading.Thread):
    """Follows the arena's write head (a u64 at `head_at` in the map, an absolute position in a
    ring of `capacity` data bytes starting at `data_at`) and faults the written data in: what the
    server writes as it comes, and between looks at the head what it wrote before, newest first
    (the pages most likely read next), a chunk at a time, each after `step_aside`. The index
    (`extra`: (offset, length)) once at start. Ends when `owner` closes (`closed(owner)`) or is
    collected; `stop()` waits for the chunk under way, so no madvise outlives the map."""

    def __init__(self, owner: Any, address: int, head_at: int, data_at: int, capacity: int,
                 extra: tuple[int, int], closed: Callable[[Any], bool]) -> None:
        super().__init__(name="tiered-cache-read-ahead", daemon=True)
        self._owner = weakref.ref(owner)
        self._address, self._head_at, self._data_at, self._capacity = address, head_at, data_at, capacity
        self._extra = extra
        self._closed = closed
        self._stopping = threading.Event()
        self._chunk_lock = threading.Lock()
        self.mapped_to = 0  # absolute position up to which the written data is faulted in ...
        self.mapped_from = 0  # ... and from which: [mapped_from, mapped_to) is (set after each chunk)
        self._offered: bool | None = None  # MADV_POPULATE_READ works here (None: not tried yet)

    def run(self) -> None:
        self._offered = self._advise(*self._extra)
        if not self._offered:
            return  # not offered here: reads fault pages in, as without this thread
        head = self._head()
        if head is None:
            return
        # [oldest, older): written before and not yet mapped, mapped from `older` down (the newest
        # first: what a reader is likeliest to ask for next); [mapped_to, head): written since.
        self.mapped_from = self.mapped_to = older = head
        oldest = max(0, head - self._capacity)  # what the ring still holds (it grows as the head moves)
        while not self._stopping.is_set():
            head = self._head()
            if head is None:
                return
            # What is written now comes first; what a lap of the ring wrote over is skipped.
            self.mapped_to = max(self.mapped_to, head - self._capacity)
            while self.mapped_to < head and not self._stopping.is_set():
                stop = min(head, self.mapped_to + min(_CHUNK_BYTES, self._capacity))
                if not self._advise_ring(self.mapped_to, stop):
                    return
                self.mapped_to = stop
            oldest = max(oldest, head - self._capacity)
            if older > oldest:  # then the rest of the ring, newest first, a chunk between looks at the head
                start = max(oldest, older - _CHUNK_BYTES)
                if not self._advise_ring(start, older):
                    return
                older = self.mapped_from = start
                continue
            self._stopping.wait(_POLL_S)

    def _advise_ring(self, start: int, stop: int) -> bool:
        """Fault in absolute positions [start, stop) of the ring (split where it wraps), once no
        request is in the way (`step_aside`)."""
        wait = step_aside
        if wait is not None:
            wait()
        offset, length = start % self._capacity, stop - start
        first = min(length, self._capacity - offset)
        if not self._advise(self._data_at + offset, first):
            return False
        return first == length or self._advise(self._data_at, length - first)

    def fault_in(self, position: int, length: int) -> None:
        """Map absolute positions [position, position + length) now, unless this thread has: a
        reader about to copy a page the thread has not reached (it steps aside while requests run)
        maps it in one call, not one fault per 64 KiB. A page beyond the ring's end is left to
        fault in on its own."""
        if not self._offered or (self.mapped_from <= position and position + length <= self.mapped_to):
            return
        offset = position % self._capacity
        if offset + length > self._capacity or not self._chunk_lock.acquire(blocking=False):
            return  # mid-chunk: the thread may be closing the map; the page faults in on its own
        try:
            if not self._stopping.is_set():  # the map is open: no madvise outlives it
                madvise(self._address + self._data_at + offset, length, MADV_POPULATE_READ)
        finally:
            self._chunk_lock.release()

    def _head(self) -> int | None:
        owner = self._owner()
        if owner is None or self._closed(owner):
            return None
        raw = owner.raw
        try:
            return struct.unpack_from("<Q", raw, self._head_at)[0]
        except (ValueError, TypeError):  # closed meanwhile
            return None

    def _advise(self, offset: int, length: int) -> bool:
        with self._chunk_lock:
            if self._stopping.is_set():
                return False
            return madvise(self._address + offset, length, MADV_POPULATE_READ)

    def stop(self) -> None:
        self._stopping.set()
        with self._chunk_lock:  # the chunk under way ends before the map may be closed
            pass
