"""Same-host Get through shared memory: the store server copies each page it sends into a ring in
a memory segment, and sends where it lies instead of the bytes; a client on the same host maps the
segment read-only and copies the page out. One memcpy per side instead of gRPC's framing, socket
and HTTP/2 copies: a 35 MB prefix arrives in about half the time of the loopback stream here
(docs/PERFORMANCE.md, "Same-host Get through shared memory").

Layout of the segment: a 64-byte header (magic, the segment's random id, the write cursor, the
ring's capacity, the index's slot count, the server's heartbeat), then the ring, then the index.
Positions are absolute (they only grow); a page at position P with length n lies at
`HEADER + P % capacity` and never wraps (the writer skips the ring's tail instead).

Safety without locks between processes: the writer moves the cursor *before* it copies a page in,
so a reader that copied a page out and then reads a cursor of at most P + capacity knows no later
page was written over it (x86 keeps stores and loads in order; elsewhere the checksum that every
received blob still goes through catches a torn page). A page written over is a miss the client
asks again as bytes, never wrong KV.

The ring also remembers where each key's page lies while it is in the newer half of the ring: a
page placed at Put time or sent by a recent Get is sent again by position, without a copy (keys
are content-addressed, and the client checks key and checksum of whatever it reads). A Lookup
from a client that mapped the ring is answered with those positions too (`find`): the client
then reads the pages without a Get at all.

Where pages lie is also published in the segment itself, after the ring: an index of
direct-mapped slots (one per hash of the key, the newest page wins a slot), each guarded by a
sequence number that is odd while the server writes it. A client on this host answers a Lookup
of pages that all lie findable in the ring from the index, without an RPC (`ShmReader.find`): a
Lookup RPC costs two process hops and the server's event loop, a read of the index a few
microseconds. A key not in the index (evicted from the ring, never placed, a slot taken by
another key) is asked by RPC as before: the index only ever says where a page *is*. The server
stamps the header with a heartbeat (`beat`); a client answers from the index only while it is
fresh and the server's process still holds the segment open, so a server that died or hangs is
asked (and its breaker opens) as before.

The segment is a memfd: it exists only while the server process does (nothing is left in
/dev/shm after a crash), and others open it through `/proc/<pid>/fd/<n>`, which only the same
user (or root) may do. Clients on another host are told apart by `host_identity()`.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

MAGIC = b"TCSHM\x00v2"
HEADER = 64
_SEGMENT = slice(8, 24)
_CURSOR = 24
_CAPACITY = 32  # u64: bytes of ring after the header
_SLOTS = 40  # u64: index slots after the ring (0: no index)
_BEAT = 48  # f64: time.monotonic() of the server's last heartbeat (same clock host-wide)
SLOT_BYTES = 64
_SLOT = struct.Struct("<Q32sQI")  # sequence (odd while written), key, position, length
BEAT_S = 0.25  # how often a server stamps its heartbeat
FRESH_S = 2.0  # a heartbeat older than this: the server is not answering for its index
MIN_BYTES = 2**20
GET_RING = "tiered-cache-get-ring"  # the server's, for Get
PUT_RING = "tiered-cache-put-ring"  # a client's, offered to a server on its host for Put (shm_offers.py)
MAX_REMEMBERED = 1 << 16  # keys whose ring position is kept (~250 B each: tiny pages must not grow it)


def largest_page(capacity: int) -> int:
    """The largest page a ring of `capacity` takes: a larger one would be written over by the
    next few, so it goes as bytes. Server and client apply the same rule."""
    return capacity // 4


def findable(position: int, cursor: int, capacity: int) -> bool:
    """Whether a page at `position` is in the ring's newer half: at least half a lap from being
    written over, so it may be handed out by position (server and client apply the same rule)."""
    return position >= cursor - capacity // 2


def index_slots_for(size: int) -> int:
    """Index slots of a Get ring of `size` bytes: a power of two, about 1/64 of the segment, at
    most MAX_REMEMBERED (the keys the ring remembers anyway)."""
    slots = 256
    while slots * 2 * SLOT_BYTES * 64 <= size and slots < MAX_REMEMBERED:
        slots *= 2
    return slots


def _slot_of(key: bytes, slots: int) -> int:
    return int.from_bytes(key[:8], "little") & (slots - 1)  # keys are SHA-256: uniform


def host_identity() -> str:
    """This machine's boot id and host name ('' where the boot id cannot be read: then no
    client ever takes a segment path for its own)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return f"{boot}/{socket.gethostname()}"


class ShmRing:
    """A ring written by this process: the server's for Get, or a client's for Put (`name`).
    `place` copies a page in (or finds it there) and returns (position, length), or None when
    the page is too large for the ring (it then goes as bytes)."""

    def __init__(self, size: int, name: str = GET_RING, index: bool = False) -> None:
        """`index`: publish where pages lie (the server's Get ring; see the module doc)."""
        if size < MIN_BYTES:
            raise ValueError(f"the shared-memory ring needs at least {MIN_BYTES} bytes, got {size}")
        self.size = size
        self.slots = index_slots_for(size) if index else 0
        self.capacity = size - HEADER - self.slots * SLOT_BYTES
        self._index_at = HEADER + self.capacity
        self.max_page = largest_page(self.capacity)
        # Sealed at its size: a reader (the server, for a client's Put ring) must not find the
        # segment shrunk under its map, which would fault (SIGBUS) instead of reading bytes.
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        # Touch every page now: the first lap of Gets would otherwise fault the ring in page by
        # page (about as slow as the loopback stream it replaces).
        zeros = memoryview(bytes(min(size, 4 << 20)))
        for offset in range(0, size, len(zeros)):
            n = min(len(zeros), size - offset)
            self._map[offset:offset + n] = zeros[:n]
        self.segment = os.urandom(16)
        self._map[:8] = MAGIC
        self._map[_SEGMENT] = self.segment
        struct.pack_into("<QQQd", self._map, _CURSOR, 0, self.capacity, self.slots, time.monotonic())
        self._cursor = 0
        self._lock = threading.Lock()
        self._where: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> page, oldest first
        self.pages = 0  # pages placed
        self.reused = 0  # of which already in the ring: sent again without a copy

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def place(self, blob: bytes | memoryview, key: bytes = b"", sent: bool = True) -> tuple[int, int] | None:
        """Where the page lies in the ring. With `key`, a page of that key still in the newer half
        of the ring (at least half a lap from being written over) is not copied again. `sent`:
        counted as a page handed over (False when placed ahead of a Get, at Put time)."""
        n = len(blob)
        if not 0 < n <= self.max_page:
            return None
        with self._lock:
            self.pages += sent
            if key:
                found = self._where.get(key)
                if found is not None and found[1] == n and self._cursor - found[0] <= self.capacity // 2:
                    self.reused += sent
                    return found
            position = self._cursor
            offset = position % self.capacity
            if offset + n > self.capacity:  # skip the tail: a page never wraps
                position += self.capacity - offset
                offset = 0
            self._cursor = position + n
            struct.pack_into("<Q", self._map, _CURSOR, self._cursor)  # before the copy: see the module doc
            self._forget_before(self._cursor - self.capacity // 2)
            if key:
                # Known only once copied in: until then a Get must not send its position. A page
                # placed meanwhile under the same key copies it again (rare, and still correct).
                self._where.pop(key, None)
        self._map[HEADER + offset:HEADER + offset + n] = blob  # outside the lock: regions are disjoint
        if key:
            with self._lock:
                if findable(position, self._cursor, self.capacity):
                    self._where[key] = (position, n)
                    self._publish(key, position, n)
                    if len(self._where) > MAX_REMEMBERED:
                        self._where.popitem(last=False)
        return position, n

    def _publish(self, key: bytes, position: int, n: int) -> None:
        """Write the key's index slot (under the lock: one writer). The sequence number is odd
        while the slot is written, so a reader never takes half of one key and half of another."""
        if not self.slots or len(key) != 32:
            return
        at = self._index_at + _slot_of(key, self.slots) * SLOT_BYTES
        sequence = struct.unpack_from("<Q", self._map, at)[0] | 1  # odd: being written
        struct.pack_into("<Q", self._map, at, sequence)
        _SLOT.pack_into(self._map, at, sequence, key, position, n)
        struct.pack_into("<Q", self._map, at, sequence + 1)

    def beat(self) -> None:
        """Stamp the heartbeat: clients answer Lookups from the index only while it is fresh."""
        struct.pack_into("<d", self._map, _BEAT, time.monotonic())

    def find(self, keys: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """Where each key's page lies while it is in the newer half of the ring (else None): a
        Lookup's answer, so a client on this host can take the pages without a Get."""
        with self._lock:
            found = [self._where.get(key) for key in keys]
            return [w if w is not None and findable(w[0], self._cursor, self.capacity) else None for w in found]

    def _forget_before(self, position: int) -> None:
        """Drop keys whose pages start before `position` (under the lock). Entries are added about
        in cursor order (copies finish out of order), so one left behind lingers a little longer;
        `place` checks every entry's age anyway."""
        where = self._where
        while where:
            key, (start, _) = next(iter(where.items()))
            if start >= position:
                break
            del where[key]

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


class ShmReader:
    """A client's read-only map of a server's ring. Raises OSError or ValueError when the path
    cannot be opened or is not the segment named (another host, another user, a reused pid)."""

    def __init__(self, path: str, size: int, segment: bytes) -> None:
        if size < MIN_BYTES:
            raise ValueError(f"segment size {size} is below the ring's minimum")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.fstat(fd)
            if stat.st_size != size:
                raise ValueError(f"{path} is not the {size}-byte segment the server named")
            self.path, self._inode = path, stat.st_ino
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if self._map[:8] != MAGIC or self._map[_SEGMENT] != segment:
            self._map.close()
            raise ValueError(f"{path} is not the segment the server named")
        self.segment = segment
        self.capacity = struct.unpack_from("<Q", self._map, _CAPACITY)[0]
        self.slots = struct.unpack_from("<Q", self._map, _SLOTS)[0]
        if HEADER + self.capacity + self.slots * SLOT_BYTES != size:
            self._map.close()
            raise ValueError(f"{path}: its header's ring and index do not add up to {size} bytes")
        self._index_at = HEADER + self.capacity
        self.max_page = largest_page(self.capacity)

    def read(self, position: int, length: int) -> bytes | None:
        """A copy of the page at `position`, or None when the ring has since been written over it
        (or the reference does not fit the ring)."""
        offset = position % self.capacity
        if not 0 < length <= self.capacity - offset:
            return None
        data = self._map[HEADER + offset:HEADER + offset + length]  # the copy
        return data if self.intact(position, length) else None  # checked after the copy: module doc

    def view(self, position: int, length: int) -> memoryview | None:
        """The page at `position` in place (no copy), or None when it is already written over.
        Valid only until the ring comes round: whoever uses it checks `intact` after copying."""
        offset = position % self.capacity
        if not 0 < length <= self.capacity - offset or not self.intact(position, length):
            return None
        return memoryview(self._map)[HEADER + offset:HEADER + offset + length]

    def find(self, keys: Sequence[bytes]) -> list[tuple[int, int]] | None:
        """Where every one of `keys` lies, findable in the ring, read from the server's index; None
        when any is not there (or the index is off, or the server's heartbeat is stale): then ask
        the server. A slot being written, or taken by another key, is not there."""
        if not self.slots or not keys or time.monotonic() - self.heartbeat() > FRESH_S or not self.server_alive():
            return None
        cursor = struct.unpack_from("<Q", self._map, _CURSOR)[0]
        found = []
        for key in keys:
            at = self._index_at + _slot_of(key, self.slots) * SLOT_BYTES
            sequence, held, position, length = _SLOT.unpack_from(self._map, at)
            if (sequence & 1 or held != key or not length or not findable(position, cursor, self.capacity)
                    or struct.unpack_from("<Q", self._map, at)[0] != sequence):
                return None
            found.append((position, length))
        return found

    def server_alive(self) -> bool:
        """Whether the process that made the segment still holds it open (its `/proc/<pid>/fd`
        entry is gone the moment it dies, before its heartbeat goes stale)."""
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False

    def heartbeat(self) -> float:
        """time.monotonic() of the server's last heartbeat."""
        return struct.unpack_from("<d", self._map, _BEAT)[0]

    def intact(self, position: int, length: int) -> bool:
        """Whether no page written since has reached the one at `position`."""
        cursor = struct.unpack_from("<Q", self._map, _CURSOR)[0]
        return position + length <= cursor <= position + self.capacity

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # pages still lent as views: unmapped when the last goes
            self._map.close()


class ShmLease:
    """Pages lent as views into server rings instead of copied out (`StoreClient.get_all(lease=)`).
    A view is good only while the ring has not come round over it: copy the pages where they go,
    then ask `lost()`; a page named there must not be used (fetch it again). One copy fewer per
    page than `ShmReader.read`."""

    def __init__(self) -> None:
        self._pages: list[tuple[bytes, ShmReader, int, int]] = []

    def add(self, key: bytes, reader: ShmReader, position: int, length: int) -> None:
        self._pages.append((key, reader, position, length))  # list.append: safe across threads

    def __len__(self) -> int:
        return len(self._pages)

    def lost(self) -> set[bytes]:
        """Keys of lent pages written over since they were lent (their views hold other bytes)."""
        return {key for key, reader, position, length in self._pages if not reader.intact(position, length)}


RingRef = tuple[ShmReader, int, int]  # a server's ring as mapped here, position, length


class LookupRefs:
    """Where pages lay in same-host servers' rings when a Lookup answered, kept for the Get that
    usually follows (a vLLM load, an engine fetch): taken once, then read straight from the ring
    with no Get. A ref may be stale by then; its reader says so (`ShmReader.intact`), and the page
    is then asked for by Get like any other. Bounded: the oldest refs go first."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._refs: OrderedDict[bytes, RingRef] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, reader: ShmReader, keys: Sequence[bytes], positions: Sequence[int],
                 lengths: Sequence[int]) -> None:
        with self._lock:
            for key, position, length in zip(keys, positions, lengths, strict=False):
                if length:
                    self._refs[key] = (reader, position, length)
                    self._refs.move_to_end(key)
            while len(self._refs) > self.capacity:
                self._refs.popitem(last=False)

    def take(self, keys: Sequence[bytes]) -> dict[bytes, RingRef]:
        with self._lock:
            return {key: ref for key in keys if (ref := self._refs.pop(key, None)) is not None}

    def __len__(self) -> int:
        return len(self._refs)

    def clear(self) -> None:
        with self._lock:
            self._refs.clear()
