"""`ReadAhead`: keeps a client's read-only map of a store server's arena faulted in as far as the
server has written, on a daemon thread.

A fresh map has no page-table entries: the first read of each 4 KiB page is a fault, so a new
reader's first load from the arena ran several times slower than its next ones, and every prefix
written since was slow again when first read. MADV_POPULATE_READ (Linux 5.14+) maps what the
server has written, reading no byte and committing nothing it has not (only written ranges are
asked for); without it pages fault in on first read, as before. The last `BACKLOG_BYTES` written
are mapped first, new writes as they come, the older rest after.
"""

from __future__ import annotations

import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

from tiered_cache.shm.advice import madvise

MADV_POPULATE_READ = 22  # Linux 5.14+: fault pages in as if read
_CHUNK_BYTES = 16 * 2**20
_POLL_S = 0.02  # how often the server's head is looked at
BACKLOG_BYTES = 1 << 30  # at start, this much of what the server wrote last is faulted in


class ReadAhead(threading.Thread):
    """Follows the arena's write head (a u64 at `head_at` in the map, an absolute position in a
    ring of `capacity` data bytes starting at `data_at`) and faults the written data in: at start
    the last `backlog` bytes written (the pages most likely read next), then what the server
    writes, and between looks at the head the rest of what was written before, newest first. The
    index (`extra`: (offset, length)) once at start. Ends when `owner` closes (`closed(owner)`) or
    is collected; `stop()` waits for the chunk under way, so no madvise outlives the map."""

    def __init__(self, owner: Any, address: int, head_at: int, data_at: int, capacity: int,
                 extra: tuple[int, int], closed: Callable[[Any], bool], backlog: int = BACKLOG_BYTES) -> None:
        super().__init__(name="tiered-cache-read-ahead", daemon=True)
        self._owner = weakref.ref(owner)
        self._address, self._head_at, self._data_at, self._capacity = address, head_at, data_at, capacity
        self._extra = extra
        self._closed = closed
        self._backlog = min(backlog, capacity)
        self._stopping = threading.Event()
        self._chunk_lock = threading.Lock()
        self.mapped_to = 0  # absolute position up to which the written data is faulted in

    def run(self) -> None:
        if not self._advise(*self._extra):
            return  # not offered here: reads fault pages in, as without this thread
        head = self._head()
        if head is None:
            return
        self.mapped_to = max(0, head - self._backlog)
        older, oldest = self.mapped_to, max(0, head - self._capacity)  # [oldest, older): written before
        while not self._stopping.is_set():
            head = self._head()
            if head is None:
                return
            while self.mapped_to < head and not self._stopping.is_set():  # what is written now comes first
                stop = min(head, self.mapped_to + _CHUNK_BYTES)
                if not self._advise_ring(self.mapped_to, stop):
                    return
                self.mapped_to = stop
            if older > oldest:  # then the rest of the ring, newest first, a chunk between looks at the head
                start = max(oldest, older - _CHUNK_BYTES)
                if not self._advise_ring(start, older):
                    return
                older = start
                continue
            self._stopping.wait(_POLL_S)

    def _advise_ring(self, start: int, stop: int) -> bool:
        """Fault in absolute positions [start, stop) of the ring (split where it wraps)."""
        offset, length = start % self._capacity, stop - start
        first = min(length, self._capacity - offset)
        if not self._advise(self._data_at + offset, first):
            return False
        return first == length or self._advise(self._data_at, length - first)

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
