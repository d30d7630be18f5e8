"""The server's read-only map of a client's put ring (put_ring.py has its layout): pages read in
place, and the check that the client has not written over one since it placed it."""

from __future__ import annotations

import contextlib
import struct

from tiered_cache.shm.host import map_read_only
from tiered_cache.shm.put_ring import CAPACITY_AT, CURSOR_AT, HEADER, MAGIC, MIN_BYTES, SEGMENT_AT


class PutRingReader:
    """The server's read-only map of a client's put ring. Raises OSError or ValueError when the
    path cannot be opened or is not the segment named."""

    def __init__(self, path: str, size: int, segment: bytes) -> None:
        if size < MIN_BYTES:
            raise ValueError(f"segment size {size} is below a put ring's minimum")
        self._map, self.inode = map_read_only(path, size)
        self.path = path
        if self._map[:8] != MAGIC or self._map[SEGMENT_AT] != segment:
            self._map.close()
            raise ValueError(f"{path} is not the segment the client named")
        self.segment = segment
        self.size = size  # bytes mapped: the client's memory, shared with this process
        self.capacity = struct.unpack_from("<Q", self._map, CAPACITY_AT)[0]
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
        cursor = struct.unpack_from("<Q", self._map, CURSOR_AT)[0]
        return position + length <= cursor <= position + self.capacity

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._map.close()
