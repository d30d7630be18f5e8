"""The arena: the store server's RAM tier, in shared memory that same-host clients read in place.

The server keeps the blobs of its RAM tier in one sealed memfd. A client on the same host (same
user, same boot id) maps it read-only and copies a page from there straight to where it goes
(its pool page, or by DMA to the GPU): the server copies nothing for a same-host Get. A client
on another host gets the same pages as bytes over gRPC.

Layout: a 4 KiB header (magic, the arena's random id, the tail, the capacity, the head, the index's
bucket count), then `capacity` bytes of data, then the published index. The data is a log: each blob
is written at the head, at absolute position P (positions only grow), lying at `DATA + P %
capacity` and never wrapping (the head skips the end of the data instead). Placing a blob first
erases what lies in its way, oldest first, and publishes the new tail *before* writing a byte (one
writer, the server, under its lock). So a reader that copied the page at P and then reads `tail <=
P` knows no byte of it was written over: x86 keeps stores and loads in order, and elsewhere the
CRC-32C that every page still goes through catches a torn one. A page written over is a miss the
reader asks again.

The index publishes where each page was last placed: direct-mapped 64-byte buckets (the key's
first bytes pick the bucket, the newest placement wins it), each written under a sequence number
that is odd while the server writes it. A client answers a Lookup from it without an RPC when
every key is in its bucket and still intact (`ArenaMap.find`); any other Lookup goes to the server.
The index only ever says where a page is: a key it lacks is asked of the server.

Eviction is the log's order with a second chance: a blob read since it was placed is written
again at the head instead of dropped (a hot prefix stays; a one-time one goes), and a dropped
blob goes to the tier below (`on_evict`), as from any RAM tier. A ref handed out is leased for
`lease_s`: the head does not write over a leased blob; a blob that finds the oldest one leased
goes to the tier below instead. Leases end by themselves, so a client killed while holding some
holds nothing past `lease_s`; a reader slower than that still never uses a wrong page (the tail).

The segment is sealed against shrinking and growing, and against any writer but this process's
own map (`F_SEAL_FUTURE_WRITE`): another process of the same user may open it through
`/proc/<pid>/fd/<n>` but can neither write nor truncate it. It lives while the server does and
while a client still maps it (a client's reads of a dead server's arena stay valid: nobody can
write it any more).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tiered_cache.model.units import parse_size
from tiered_cache.shm.advice import prefault_async
from tiered_cache.shm.host import sealed_segment

MAGIC = b"TCARENA1"
DATA = 4096  # the header's size: data starts page-aligned
_ID = slice(8, 24)
_TAIL = 24  # u64: bytes before this absolute position may be written over
_CAPACITY = 32  # u64: bytes of data after the header
_HEAD = 40  # u64: where the next blob goes
_BUCKETS = 48  # u64: buckets of the published index, after the data
BUCKET = struct.Struct("<Q32sQI")  # sequence (odd while written), key, position, length
BUCKET_BYTES = 64
ARENA_NAME = "tiered-cache-arena"
LEASE_S = 2.0  # how long a handed-out ref is not written over
MIN_CAPACITY = 2**20

Ref = tuple[int, int]  # (position, length)
# Called with (key, blob) pairs the arena drops or cannot place, for the tier below to take.
OnEvict = Callable[[list[tuple[bytes, bytes]]], None]


def index_buckets(capacity: int) -> int:
    """Buckets of the published index of an arena of `capacity` bytes: a power of two, about one
    per 32 KiB of data (pages are rarely smaller), 256 to 2**20."""
    buckets = 256
    while buckets * 32 * 1024 < capacity and buckets < 2**20:
        buckets *= 2
    return buckets


def bucket_of(key: bytes, buckets: int) -> int:
    """The index bucket of `key` (keys are SHA-256: their first bytes are uniform)."""
    return int.from_bytes(key[:8], "little") & (buckets - 1)


def largest_blob(capacity: int) -> int:
    """The largest blob an arena of `capacity` takes (a larger one goes to the tier below):
    a blob of half the arena would erase half the arena to be placed."""
    return capacity // 4


@dataclass
class ArenaStats:
    """What an arena counted (counters only grow) and what it holds now (`pages`, `used`)."""

    pages: int = 0
    used: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0


# The server's record of a blob (key, position, lease) lives outside the arena: some 270 bytes of
# objects, about 640 in resident memory once a flood of tiny pages has churned the allocator. Each
# record is charged RECORD_BYTES against the capacity beside its blob (`used`), and there is at most
# one record per CAPACITY_PER_RECORD bytes of capacity, so the records of an arena of the smallest
# pages stay within a third of it (the data, touched whole once the head comes round, is the rest
# of the server's bound); pages of 2 KiB and more never meet the count, and blobs stay back to back
# (a run of pages is one copy).
RECORD_BYTES = 512
CAPACITY_PER_RECORD = 2048


@dataclass(slots=True)
class _Record:
    position: int
    length: int
    read: bool = False  # read since placed: a second chance when the head comes round
    leased_until: float = 0.0


class Arena:
    """The server's side: places blobs, hands out refs, evicts. Thread-safe (one lock)."""

    def __init__(self, capacity: int | str, on_evict: OnEvict | None = None, lease_s: float = LEASE_S) -> None:
        self.capacity = parse_size(capacity)
        if self.capacity < MIN_CAPACITY:
            raise ValueError(f"the arena needs at least {MIN_CAPACITY} bytes, got {self.capacity}")
        self.buckets = index_buckets(self.capacity)
        self.index_at = DATA + self.capacity
        self.size = self.index_at + self.buckets * BUCKET_BYTES
        self.on_evict = on_evict
        self.lease_s = lease_s
        self.max_blob = largest_blob(self.capacity)
        self.max_records = max(1, self.capacity // CAPACITY_PER_RECORD)
        self.fd, self._map = sealed_segment(ARENA_NAME, self.size, writers_only_me=True)
        self.id = os.urandom(16)
        self._map[:8] = MAGIC
        self._map[_ID] = self.id
        struct.pack_into("<QQQQ", self._map, _TAIL, 0, self.capacity, 0, self.buckets)
        self._head = 0
        self._tail = 0
        self._records: OrderedDict[bytes, _Record] = OrderedDict()  # in position order
        self._lock = threading.Lock()
        self.used = 0  # bytes of live blobs, and RECORD_BYTES per record (what an entry costs)
        self.second_chances = 0  # blobs written again at the head because they had been read
        self.lease_blocked = 0  # blobs sent below because the oldest blob was leased
        self._counts = ArenaStats()
        # Memory just past the head faulted in by a background thread (shm/advice.py), so a
        # Put's copies do not pay the first pass's faults themselves.
        self._prefault = prefault_async(self._map, self, _written_below)

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    # --- reading -----------------------------------------------------------------------------------
    def refs(self, keys: Sequence[bytes], lease: bool = True, count_misses: bool = True) -> list[Ref | None]:
        """Where each key's blob lies (None: not here), each leased for `lease_s` (a client reads
        it in place). Counts as a read: hits, bytes out, and misses unless `count_misses` (a
        caller that looks below next)."""
        until = time.monotonic() + self.lease_s if lease else 0.0
        out: list[Ref | None] = []
        with self._lock:
            for key in keys:
                record = self._records.get(key)
                if record is None:
                    out.append(None)
                    self._counts.misses += count_misses
                    continue
                record.read = True
                record.leased_until = max(record.leased_until, until)
                out.append((record.position, record.length))
                self._counts.hits += 1
                self._counts.bytes_out += record.length
        return out

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """A copy of each key's blob (for clients on other hosts, and the tiers below)."""
        with self._lock:
            out = [self._copy(key) for key in keys]
            for blob in out:
                if blob is None:
                    self._counts.misses += 1
                else:
                    self._counts.hits += 1
                    self._counts.bytes_out += len(blob)
        return out

    def _copy(self, key: bytes) -> bytes | None:
        record = self._records.get(key)
        if record is None:
            return None
        record.read = True
        at = DATA + record.position % self.capacity
        return self._map[at:at + record.length]

    def head(self, key: bytes, n: int) -> bytes | None:
        """The first `n` bytes of `key`'s blob, or None; not a read (no figures, no second chance)."""
        with self._lock:
            record = self._records.get(key)
            if record is None:
                return None
            at = DATA + record.position % self.capacity
            return bytes(self._map[at:at + min(n, record.length)])

    def matches(self, ref: Ref, test: Callable[[memoryview], bool]) -> bool:
        """`test` of the blob at `ref`, read in place (a Get's fingerprint filter)."""
        position, length = ref
        at = DATA + position % self.capacity
        with self._lock, memoryview(self._map) as whole:
            return test(whole[at:at + length])

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._records for key in keys]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the arena holds."""
        with self._lock:
            held = 0
            for key in keys:
                if key not in self._records:
                    break
                held += 1
            return held

    def items(self) -> list[tuple[bytes, bytes]]:
        """Every blob held, oldest first (a flush at shutdown)."""
        with self._lock:
            return [(key, blob) for key in list(self._records) if (blob := self._copy(key)) is not None]

    # --- writing -----------------------------------------------------------------------------------
    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> int:
        """Place each blob not held yet; returns how many were placed. Blobs that do not go in (too
        large, or the oldest blob is leased) and blobs evicted to make room go to `on_evict`."""
        stored = 0
        below: list[tuple[bytes, bytes]] = []
        with self._lock:
            for key, blob in items:
                held = self._records.get(key)
                if held is not None:  # put again: as good as a read (a second chance when erased)
                    held.read = True
                    continue
                if self._place(key, blob, below):
                    stored += 1
                    self._counts.bytes_in += len(blob)
                elif self.on_evict is not None:  # too large, or the oldest blob leased: below
                    below.append((key, bytes(blob)))
        if below and self.on_evict is not None:
            self.on_evict(below)
        return stored

    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget these keys, in the published index too (a blob deleted may be one that must not
        be read); their bytes stay until the head comes round."""
        with self._lock:
            for key in keys:
                record = self._records.pop(key, None)
                if record is not None:
                    self.used -= record.length + RECORD_BYTES
                    self._publish(key, 0, 0)

    def _place(self, key: bytes, blob: bytes | memoryview, below: list[tuple[bytes, bytes]]) -> bool:
        """Write `blob` at the head (under the lock), erasing what lies in its way; False when it
        cannot go in (too large, or the oldest blob is leased). Erased blobs read since they were
        placed are written again at the head first (second chance, once per read: a hot prefix
        stays), so the new blob is the newest; the others erased go to `below`."""
        n = len(blob)
        if not 0 < n <= self.max_blob:
            return False
        while True:
            position, end = self._place_at_head(n)
            limit = end - self.capacity
            limit = max(limit, self._oldest_to_drop(n))
            again: list[tuple[bytes, bytes]] = []
            if not self._erase_before(limit, again, below):
                self.lease_blocked += 1
                below.extend(again)
                return False
            if not again:
                break
            self._second_chances(again, below)  # the head moved: find the blob's place again
        self._write(key, blob, position, end)
        return True

    def _oldest_to_drop(self, n: int) -> int:
        """The position below which records go so that a blob of `n` bytes and its record fit the
        charge (`used`) and the record count (under the lock); 0 when nothing need go for them."""
        over = self.used + n + RECORD_BYTES - self.capacity
        count_over = len(self._records) + 1 - self.max_records
        limit = 0
        for record in self._records.values():  # oldest first
            if over <= 0 and count_over <= 0:
                break
            over -= record.length + RECORD_BYTES
            count_over -= 1
            limit = record.position + 1
        return limit

    def _second_chances(self, again: list[tuple[bytes, bytes]], below: list[tuple[bytes, bytes]]) -> None:
        """Write erased, read blobs again at the head, with their read mark cleared; what they
        erase in turn is handled the same way (each blob at most once per read: it ends)."""
        while again:
            key, blob = again.pop(0)
            position, end = self._place_at_head(len(blob))
            if not self._erase_before(end - self.capacity, again, below):
                self.lease_blocked += 1
                below.append((key, blob))
                continue
            self._write(key, blob, position, end)
            self.second_chances += 1

    def _place_at_head(self, n: int) -> tuple[int, int]:
        """Where a blob of `n` bytes goes: (position, end) at the head; a blob never wraps, so
        it skips the end of the data instead."""
        position = self._head
        offset = position % self.capacity
        if offset + n > self.capacity:
            position += self.capacity - offset
        return position, position + n

    def _write(self, key: bytes, blob: bytes | memoryview, position: int, end: int) -> None:
        """Copy the blob in at `position` (its way erased: the tail is at or past end - capacity)."""
        self._head = end
        struct.pack_into("<Q", self._map, _HEAD, end)
        at = DATA + position % self.capacity
        self._map[at:at + len(blob)] = blob
        self._prefault.nudge()
        self._records[key] = _Record(position, len(blob))
        self.used += len(blob) + RECORD_BYTES
        self._publish(key, position, len(blob))

    def _publish(self, key: bytes, position: int, length: int) -> None:
        """Write the key's index bucket (under the lock: one writer); length 0 says not here. Its
        sequence number is odd while the bucket is written, so a reader never takes half of one key
        and half of another. Eviction does not clear buckets: a reader checks the page is still
        intact, so a bucket of a page written over reads as not there."""
        at = self.index_at + bucket_of(key, self.buckets) * BUCKET_BYTES
        sequence = struct.unpack_from("<Q", self._map, at)[0] | 1
        struct.pack_into("<Q", self._map, at, sequence)
        BUCKET.pack_into(self._map, at, sequence, key, position, length)
        struct.pack_into("<Q", self._map, at, sequence + 1)

    def _erase_before(self, limit: int, pending: list[tuple[bytes, bytes]],
                      below: list[tuple[bytes, bytes]]) -> bool:
        """Drop every record that starts below `limit` and publish the tail (under the lock);
        False, erasing nothing more, when the oldest such record is leased. A record read since it
        was placed is copied out to be placed again (`pending`); others go to `below`."""
        now = time.monotonic()
        records = self._records
        while records:
            key, record = next(iter(records.items()))
            if record.position >= limit:
                break
            if record.leased_until > now:
                return False
            del records[key]
            self.used -= record.length + RECORD_BYTES
            at = DATA + record.position % self.capacity
            if record.read:
                pending.append((key, self._map[at:at + record.length]))
            else:
                self._counts.evictions += 1
                if self.on_evict is not None:  # copied out only for a tier below to take
                    below.append((key, self._map[at:at + record.length]))
        if limit > self._tail:
            self._tail = limit
            struct.pack_into("<Q", self._map, _TAIL, limit)  # before any byte below it is written
        return True

    # --- stats -------------------------------------------------------------------------------------
    def arena_stats(self) -> ArenaStats:
        """A copy of the arena's stats, taken under its lock (a tier over it turns them into `TierStats`)."""
        with self._lock:
            return replace(self._counts, pages=len(self._records), used=self.used)

    def check(self) -> None:
        """Integrity (tests call it after each step): records in position order, disjoint, within
        [tail, head], `used` their charge, the header's tail and head this object's."""
        with self._lock:
            last_end = self._tail
            total = 0
            for record in self._records.values():
                assert record.position >= last_end, "records overlap or lie below the tail"
                assert record.position % self.capacity + record.length <= self.capacity, "a record wraps"
                last_end = record.position + record.length
                total += record.length + RECORD_BYTES
            assert last_end <= self._head, "a record lies past the head"
            assert total == self.used, f"used is {self.used}, records hold {total}"
            tail, capacity, head = struct.unpack_from("<QQQ", self._map, _TAIL)
            assert (tail, capacity, head) == (self._tail, self.capacity, self._head), "header out of date"

    def close(self) -> None:
        """Unmap and close: clients that map it keep their pages; nothing is written any more."""
        self._prefault.stop()
        self._map.close()
        os.close(self.fd)


def _written_below(arena: Arena) -> int:
    """Where the arena's writes have reached in its map (all of its data once the head came
    round), for its prefault thread."""
    return DATA + min(arena._head, arena.capacity)
