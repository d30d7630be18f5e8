"""A client's put ring: the segment a same-host client writes the pages it puts into, so that
the server copies each page once, from there into its arena, instead of receiving it over gRPC
(the server's side: put_ring_reader.py maps one ring, offers.py the rings clients offer).

Layout: a 64-byte header (magic, the segment's random id, the write cursor, the capacity), then
the ring. Positions are absolute (they only grow); a page at position P with length n lies at
`HEADER + P % capacity` and never wraps (the writer skips the ring's end instead). The writer
moves the cursor *before* it copies a page in, so the server, having copied a page out, knows it
is intact when the cursor is still at most P + capacity; the server also verifies every page's
CRC-32C, so a page the client wrote over early is refused, never stored.
"""

from __future__ import annotations

import os
import struct
import threading

from tiered_cache.shm.advice import prefault_async
from tiered_cache.shm.host import sealed_segment

MAGIC = b"TCPUTv3\x00"
HEADER = 64
SEGMENT_AT = slice(8, 24)  # where in the header: the segment's id, the cursor, the capacity
CURSOR_AT = 24
CAPACITY_AT = 32
MIN_BYTES = 2**20
PUT_RING = "tiered-cache-put-ring"  # the memfd's name: the server maps nothing else for Put


class PutRing:
    """The client's side: `place` copies a page in and returns (position, length), or None when
    the page is too large for the ring (it then goes as bytes). Thread-safe."""

    def __init__(self, size: int) -> None:
        if size < MIN_BYTES:
            raise ValueError(f"a put ring needs at least {MIN_BYTES} bytes, got {size}")
        self.size = size
        self.capacity = size - HEADER
        self.max_page = self.capacity // 4
        self.fd, self._map = sealed_segment(PUT_RING, size)
        self.segment = os.urandom(16)
        self._map[:8] = MAGIC
        self._map[SEGMENT_AT] = self.segment
        struct.pack_into("<QQ", self._map, CURSOR_AT, 0, self.capacity)
        self._cursor = 0
        self._lock = threading.Lock()
        self._prefault = prefault_async(self._map, self, lambda ring: HEADER + min(ring._cursor, ring.capacity))

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def place(self, blob: bytes | memoryview) -> tuple[int, int] | None:
        n = len(blob)
        if not 0 < n <= self.max_page:
            return None
        with self._lock:
            position = self._cursor
            offset = position % self.capacity
            if offset + n > self.capacity:  # skip the end: a page never wraps
                position += self.capacity - offset
                offset = 0
            self._cursor = position + n
            struct.pack_into("<Q", self._map, CURSOR_AT, self._cursor)  # before the copy: module doc
        self._prefault.nudge()  # the next pages, faulted in meanwhile (advice.py)
        self._map[HEADER + offset:HEADER + offset + n] = blob  # outside the lock: regions are disjoint
        return position, n

    def close(self) -> None:
        self._prefault.stop()
        self._map.close()
        os.close(self.fd)
