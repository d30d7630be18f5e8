"""Same-host Put: the put rings that clients on the server's host offer, mapped by the server.

A client on the store server's host writes the pages it puts into a ring of its own (a memfd,
`PutRing`, put_ring.py), offers that segment once (`Offer`), and then sends each Put item as
(segment, position, length) instead of the bytes. The server maps the segment read-only, verifies
each page where it lies like any received blob, copies it once, into its arena, and then checks
the client's ring had not come round over it meanwhile (`PutRingReader.intact`): a page the client
overwrote early is dropped again and refused (`SHM_LOST`), garbage at a position is refused as
corrupt; neither is ever read as KV (a reader that found it in between fails its checksum).
A loopback Put stream costs each side milliseconds of CPU per MiB (docs/PERFORMANCE.md, "What a
Put costs each side"); one memcpy per side is what lets write-behind to a same-host store keep
off the request path's cores.

What the server accepts, so that an offer cannot make it read anything but a client's ring: the
caller must come over loopback or a Unix socket, from this host (`host_identity`), run as the
server's user, and name `/proc/<pid>/fd/<n>` of a memfd called `PUT_RING` whose header carries
the segment id it offers. The segment must be sealed against shrinking (a
shrunk segment would fault the server's map). The server holds at most `capacity` segments (the
oldest is unmapped first) and unmaps those whose client closed them or exited, at each offer and
at most once a second while Puts come in: a mapping keeps the client's memory alive.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from tiered_cache.shm.host import host_identity
from tiered_cache.shm.put_ring import MIN_BYTES, PUT_RING
from tiered_cache.shm.put_ring_reader import PutRingReader

_PROC_FD = re.compile(r"/proc/(\d+)/fd/(\d+)")
_LOCAL_PEERS = ("ipv4:127.", "ipv6:[::1]", "ipv6:%5B::1%5D", "unix:")
MAX_OFFER_BYTES = 2**30  # a client's ring larger than this is refused (it is mapped by the server)


@dataclass
class _Offered:
    reader: PutRingReader
    path: str
    inode: int  # the memfd's: gone from `path`, or another file there, means the client let it go


class OfferedSegments:
    """Client segments mapped for Put, by segment id; thread-safe."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._segments: OrderedDict[bytes, _Offered] = OrderedDict()
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    def __len__(self) -> int:
        return len(self._segments)

    def offer(self, path: str, size: int, segment: bytes, host: str, peer: str) -> str:
        """Map the client's segment; '' when accepted, else why not (the client then sends bytes)."""
        if not peer.startswith(_LOCAL_PEERS):
            return f"shared memory is for clients on the server's host; this call came from {peer}"
        if not host or host != host_identity():
            return "the client is on another host (or in another container) than the server"
        if not MIN_BYTES <= size <= MAX_OFFER_BYTES:
            return f"a segment of {size} bytes is outside {MIN_BYTES}..{MAX_OFFER_BYTES}"
        if len(segment) != 16:
            return f"segment id is {len(segment)} bytes, expected 16"
        match = _PROC_FD.fullmatch(path)
        if match is None:
            return f"{path!r} is not a /proc/<pid>/fd/<n> path"
        pid = int(match.group(1))
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                return f"process {pid} runs as another user than the server"
            if not os.readlink(path).startswith(f"/memfd:{PUT_RING}"):
                return f"{path} is not a tiered-cache Put ring"
            reader = PutRingReader(path, size, segment)  # refuses a segment not sealed against shrinking
        except (OSError, ValueError) as exc:
            return f"cannot map {path}: {exc}"
        with self._lock:
            self._drop_released()
            old = self._segments.pop(segment, None)
            self._segments[segment] = _Offered(reader, path, reader.inode)
            while len(self._segments) > self.capacity:
                _, oldest = self._segments.popitem(last=False)
                oldest.reader.close()
        if old is not None:
            old.reader.close()
        return ""

    def mapped_bytes(self) -> int:
        """Bytes of clients' rings mapped now (their memory, shared with this process)."""
        with self._lock:
            return sum(offered.reader.size for offered in self._segments.values())

    def reader(self, segment: bytes) -> PutRingReader | None:
        with self._lock:
            offered = self._segments.get(segment)
            return offered.reader if offered is not None else None

    def view(self, segment: bytes, position: int, length: int) -> tuple[memoryview | None, PutRingReader | None, str]:
        """The page in place in the client's ring (no copy) and the ring's reader, to check it
        `intact` after copying it; or (None, None, why) when the segment is not mapped or the
        page was written over already."""
        reader = self.reader(segment)
        if reader is None:
            return None, None, "the offered segment is not mapped here (the server restarted?); send bytes"
        try:
            data = reader.view(position, length)
        except ValueError:  # unmapped meanwhile (its process exited, or it was replaced)
            data = None
        if data is None:
            return None, None, f"the client's ring came round over the page at {position} before the server read it"
        return data, reader, ""

    def sweep(self) -> None:
        """Unmap segments their clients have let go (at most once a second; a stat per segment)."""
        now = time.monotonic()
        if now - self._swept < 1.0:
            return
        with self._lock:
            self._swept = now
            self._drop_released()

    def _drop_released(self) -> None:
        """Unmap segments whose process exited or closed them (under the lock): the server's map
        would otherwise keep the client's memory alive."""
        for segment, offered in list(self._segments.items()):
            try:
                held = os.stat(offered.path).st_ino == offered.inode
            except OSError:
                held = False
            if not held:
                del self._segments[segment]
                offered.reader.close()

    def close(self) -> None:
        with self._lock:
            for offered in self._segments.values():
                offered.reader.close()
            self._segments.clear()

