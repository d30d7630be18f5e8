"""A client's read-only map of a same-host store server's arena (arena.py), and the refs and
views it reads through.

A page is read where it lies: copied (or DMA'd) from the map to where it goes, then checked
`intact` (the arena's tail has not passed it: no byte of it was written over during the copy),
and verified by its CRC-32C like any received blob. A page that is not intact is asked again.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tiered_cache.shm.arena import (
    _BUCKETS,
    _CAPACITY,
    _HEAD,
    _ID,
    _TAIL,
    BUCKET,
    BUCKET_BYTES,
    DATA,
    MAGIC,
    bucket_of,
    largest_blob,
)
from tiered_cache.shm.host import map_read_only, still_open
from tiered_cache.shm.read_ahead import ReadAhead


class ArenaMap:
    """A server's arena, mapped read-only. Raises OSError or ValueError when the path cannot be
    opened or is not the arena named (another host, another user, a reused pid)."""

    def __init__(self, path: str, size: int, arena_id: bytes) -> None:
        if size <= DATA:
            raise ValueError(f"an arena of {size} bytes holds no data")
        self._map, self._inode = map_read_only(path, size)
        self.path = path
        if self._map[:8] != MAGIC or self._map[_ID] != arena_id:
            self._map.close()
            raise ValueError(f"{path} is not the arena the server named")
        self.id = arena_id
        self.capacity = struct.unpack_from("<Q", self._map, _CAPACITY)[0]
        self.buckets = struct.unpack_from("<Q", self._map, _BUCKETS)[0]
        self.index_at = DATA + self.capacity
        if self.index_at + self.buckets * BUCKET_BYTES != size or self.buckets & (self.buckets - 1):
            self._map.close()
            raise ValueError(f"{path}: its header's capacity and index do not add up to {size} bytes")
        self.max_page = largest_blob(self.capacity)
        self._on_close: list[Callable[[ArenaMap], None]] = []
        self._closing = False
        self._close_lock = threading.Lock()
        # What the server has written, faulted in off the request path (read_ahead.py).
        self._read_ahead = ReadAhead(self, self.address(), _HEAD, DATA, self.capacity,
                                     (self.index_at, size - self.index_at), lambda m: m.closed)
        self._read_ahead.start()
        _announce(self)

    @property
    def raw(self) -> mmap.mmap:
        """The map itself (read-only), for a copier that reads positions it was given."""
        return self._map

    def on_close(self, callback: Callable[[ArenaMap], None]) -> bool:
        """Call `callback(self)` before the map is closed (e.g. to unregister it from CUDA). False,
        and nothing kept, when the map is closing or closed already."""
        with self._close_lock:
            if self._closing:
                return False
            self._on_close.append(callback)
            return True

    @property
    def segment(self) -> bytes:
        """The arena's id, as requests name it (`shm_segment`)."""
        return self.id

    def _at(self, position: int, length: int) -> int | None:
        offset = position % self.capacity
        return DATA + offset if 0 < length <= self.capacity - offset else None

    def read(self, position: int, length: int) -> bytes | None:
        """A copy of the page at `position`, or None when it has been written over (or the ref
        does not fit the arena)."""
        at = self._at(position, length)
        if at is None:
            return None
        data = self._map[at:at + length]  # the copy
        return data if self.intact(position, length) else None  # checked after the copy: arena.py

    def view(self, position: int, length: int) -> memoryview | None:
        """The page at `position` in place (no copy), or None when it is already written over.
        Whoever uses it checks `intact` after copying it."""
        at = self._at(position, length)
        if at is None or not self.intact(position, length):
            return None
        self._read_ahead.fault_in(position, length)  # one call where the read-ahead has not been
        return memoryview(self._map)[at:at + length]

    def find(self, keys: Sequence[bytes]) -> list[tuple[int, int]] | None:
        """Where every one of `keys` lies, from the published index, or None when any is not
        there (no bucket of its own, being written, or written over since): then ask the server."""
        found = []
        for key in keys:
            if len(key) != 32 or not self.buckets:
                return None
            at = self.index_at + bucket_of(key, self.buckets) * BUCKET_BYTES
            sequence, held, position, length = BUCKET.unpack_from(self._map, at)
            if (sequence & 1 or held != key or not length or not self.intact(position, length)
                    or struct.unpack_from("<Q", self._map, at)[0] != sequence):
                return None
            found.append((position, length))
        return found

    def intact(self, position: int, length: int) -> bool:
        """Whether no byte of the page at `position` has been written over (the tail is below it)."""
        return struct.unpack_from("<Q", self._map, _TAIL)[0] <= position

    def server_alive(self) -> bool:
        """Whether the server that made the arena still holds it open."""
        return still_open(self.path, self._inode)

    @property
    def closed(self) -> bool:
        """Closing or closed: no new use of the map should begin."""
        return self._closing or self._map.closed

    def address(self) -> int:
        """Where the map starts in this process (to register it with CUDA)."""
        import numpy as np

        return int(np.frombuffer(self._map, dtype=np.uint8).ctypes.data)

    @property
    def size(self) -> int:
        return len(self._map)

    def close(self) -> None:
        with self._close_lock:
            self._closing = True  # no callback is added after this: `on_close` says so instead
            callbacks, self._on_close = self._on_close, []
        self._read_ahead.stop()
        for callback in callbacks:
            callback(self)
        with contextlib.suppress(BufferError):  # pages still lent as views: unmapped when the last goes
            self._map.close()


_LIVE: weakref.WeakSet[ArenaMap] = weakref.WeakSet()  # every map of this process not yet collected
_WATCHERS: list[Callable[[ArenaMap], None]] = []
_WATCH_LOCK = threading.Lock()


def watch_maps(callback: Callable[[ArenaMap], None]) -> Callable[[], None]:
    """Call `callback(map)` for every arena map of this process now, and for each mapped from now
    on (on the thread that maps it: keep it short); returns the call that stops it. For a CUDA
    engine that registers maps with the driver before the first load reads them."""
    with _WATCH_LOCK:
        _WATCHERS.append(callback)
        live = list(_LIVE)
    for arena in live:
        callback(arena)

    def stop() -> None:
        with _WATCH_LOCK, contextlib.suppress(ValueError):
            _WATCHERS.remove(callback)

    return stop


def _announce(arena: ArenaMap) -> None:
    with _WATCH_LOCK:
        _LIVE.add(arena)
        watchers = list(_WATCHERS)
    for callback in watchers:
        callback(arena)


class ArenaViews:
    """Pages lent as views into arena maps instead of copied out (`StoreClient.get_whole(lease=)`).
    A view is good only while the arena has not written over it: copy the pages where they go,
    then ask `lost()`; a page named there must not be used (get it again)."""

    def __init__(self) -> None:
        self._pages: list[tuple[bytes, ArenaMap, int, int]] = []
        self._keys: set[bytes] = set()

    def add(self, key: bytes, arena: ArenaMap, position: int, length: int) -> None:
        self._pages.append((key, arena, position, length))  # list.append: safe across threads
        self._keys.add(key)

    def lent(self, key: bytes) -> bool:
        """Whether `key`'s page was lent as a view (else it came as bytes)."""
        return key in self._keys

    def __len__(self) -> int:
        return len(self._pages)

    def pages(self) -> list[tuple[bytes, ArenaMap, int, int]]:
        """(key, arena, position, length) of each page lent, in the order lent."""
        return list(self._pages)

    def lost(self) -> set[bytes]:
        """Keys of lent pages written over since they were lent (their views hold other bytes)."""
        return {key for key, arena, position, length in self._pages if not arena.intact(position, length)}


ArenaRef = tuple[ArenaMap, int, int]  # a server's arena as mapped here, position, length


class LookupRefs:
    """Where pages lay in same-host servers' arenas when a Lookup answered, kept for the get
    that usually follows (a load after a match): taken once, then read straight from the arena
    with no Get. A ref may be stale by then; its map says so (`ArenaMap.intact`), and the page is
    then asked for by Get like any other. Bounded: the oldest refs go first."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._refs: OrderedDict[bytes, ArenaRef] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, arena: ArenaMap, keys: Sequence[bytes], positions: Sequence[int],
                 lengths: Sequence[int]) -> None:
        with self._lock:
            for key, position, length in zip(keys, positions, lengths, strict=False):
                if length:
                    self._refs[key] = (arena, position, length)
                    self._refs.move_to_end(key)
            while len(self._refs) > self.capacity:
                self._refs.popitem(last=False)

    def take(self, keys: Sequence[bytes]) -> dict[bytes, ArenaRef]:
        with self._lock:
            return {key: ref for key in keys if (ref := self._refs.pop(key, None)) is not None}

    def __len__(self) -> int:
        return len(self._refs)

    def clear(self) -> None:
        with self._lock:
            self._refs.clear()
