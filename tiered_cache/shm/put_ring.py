"""A client's put ring: the segment a same-host client writes the pages it puts into, so that
the server copies each page once, from there into its arena, instead of receiving it over gRPC
(offers.py is the server's side).

Layout: a 64-byte header (magic, the segment's random id, the write cursor, the capacity), then
the ring. Positions are absolute (they only grow); a page at position P with length n lies at
`HEADER + P % capacity` and never wraps (the writer skips the ring's end instead). The writer
moves the cursor *before* it copies a page in, so the server, having copied a page out, knows it
is intact when the cursor is still at most P + capacity; the server also verifies every page's
CRC-32C, so a page the client wrote over early is refused, never stored.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading

from tiered_cache.shm.advice import prefault_async
from tiered_cache.shm.host import map_read_only, sealed_segment

MAGIC = b"TCPUTv3\x00"
HEADER = 64
_SEGMENT = slice(8, 24)
_CURSOR = 24
_CAPACITY = 32
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
        self._map[_SEGMENT] = self.segment
        struct.pack_into("<QQ", self._map, _CURSOR, 0, self.capacity)
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
            struct.pack_into("<Q", self._map, _CURSOR, self._cursor)  # before the copy: module doc
        self._prefault.nudge()  # the next pages, faulted in meanwhile (advice.py)
        self._map[HEADER + offset:HEADER + offset + n] = blob  # outside the lock: regions are disjoint
        return position, n

    def close(self) -> None:
        self._prefault.stop()
        self._map.close()
        os.close(self.fd)


class PutRingReader:
    """The server's read-only map of a client's put ring. Raises OSError or ValueError when the
    path cannot be opened or is not the segment named."""

    def __init__(self, path: str, size: int, segment: bytes) -> None:
        if size < MIN_BYTES:
            raise ValueError(f"segment size {size} is below a put ring's minimum")
        self._map, self.inode = map_read_only(path, size)
        self.path = path
        if self._map[:8] != MAGIC or self._map[_SEGMENT] != segment:
            self._map.close()
            raise ValueError(f"{path} is not the segment the client named")
        self.segment = segment
        self.capacity = struct.unpack_from("<Q", self._map, _CAPACITY)[0]
        if HEADER + self.capacity != size:
            self._map.close()
            raise ValueError(f"{path}: its header's capacity does not add up to {size} bytes")

    def view(self, position: int, length: int) -> memoryview | None:
        """The page at `position` in place (no copy), or None when the client's ring has already
        come round over it (or the reference does not fit the ring). Whoever copies it checks
        `intact` after."""
        offset = position % self.capacity
        if not 0 < length <= self.capacity - offset or not self.intact(position, length):
            return None
        return memoryview(self._map)[HEADER + offset:HEADER + offset + length]

    def intact(self, position: int, length: int) -> bool:
        """Whether the client has written nothing over the page at `position` since it placed it."""
        cursor = struct.unpack_from("<Q", self._map, _CURSOR)[0]
        return position + length <= cursor <= position + self.capacity

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._map.close()
