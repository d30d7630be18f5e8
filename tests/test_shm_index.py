"""Same-host Lookups answered from the store server's ring index (service/shm_ring.py), without an
RPC: only when every key lies findable in the ring and the server's heartbeat is fresh; anything
else is asked of the server as before, and a dead server is never answered for."""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterator

from service_helpers import make_items

from tiered_cache.service.client import StoreClient
from tiered_cache.service.process import StoreProcess
from tiered_cache.service.shm_ring import (
    _BEAT,
    FRESH_S,
    SLOT_BYTES,
    ShmReader,
    ShmRing,
    _slot_of,
    index_slots_for,
)
from tiered_cache.tiers.remote import RemoteTier


def pages(n: int, seed: int) -> list[tuple[bytes, bytes]]:
    return make_items(n, start=1000 * seed, seed=seed)


def lookups(address: str) -> int:
    """Requests the server has counted (a Lookup RPC is one)."""
    return StoreClient(address).stats().server.requests


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


@contextlib.contextmanager
def mapped(index: bool = True) -> Iterator[tuple[ShmRing, ShmReader]]:
    """A 1 MiB ring and a reader's map of it, as a client on this host has."""
    ring = ShmRing(2**20, index=index)
    reader = ShmReader(ring.path, ring.size, ring.segment)
    try:
        yield ring, reader
    finally:
        reader.close()
        ring.close()


def test_the_index_finds_every_placed_key_or_says_ask_the_server():
    with mapped() as (ring, reader):
        assert (reader.capacity, reader.slots) == (ring.capacity, ring.slots) == (ring.capacity, 256)
        placed = [ring.place(bytes([i]) * 1000, key(i)) for i in range(5)]
        assert reader.find([key(i) for i in range(5)]) == placed
        assert reader.find([key(3), key(1)]) == [placed[3], placed[1]]
        assert reader.find([key(0), key(99)]) is None  # one key it does not know: ask the server
        assert reader.find([]) is None
        for position, length in placed:
            assert reader.read(position, length) is not None


def test_a_page_past_the_newer_half_or_a_slot_taken_by_another_key_is_not_found():
    with mapped() as (ring, reader):
        old = ring.place(b"o" * 1000, key(1))
        assert reader.find([key(1)]) == [old]
        for i in range(3):  # 600 KB more: `old` is now more than half a lap back
            ring.place(bytes([i]) * 200_000, key(100 + i))
        assert reader.find([key(1)]) is None and ring.find([key(1)]) == [None]  # the same rule both sides
        # Another key hashing to the same slot: the newest page wins the slot.
        a = key(2)
        b = (int.from_bytes(a[:8], "little") + ring.slots).to_bytes(8, "little") + a[8:]
        assert _slot_of(a, ring.slots) == _slot_of(b, ring.slots)
        ring.place(b"a" * 100, a)
        where_b = ring.place(b"b" * 100, b)
        assert reader.find([a]) is None and reader.find([b]) == [where_b]


def test_a_slot_being_written_or_a_stale_heartbeat_is_not_trusted():
    """A writer stopped between its two sequence stamps, and a server that stopped beating, cannot
    be had on demand: the test writes those states into the segment itself."""
    with mapped() as (ring, reader):
        where = ring.place(b"x" * 1000, key(7))
        assert reader.find([key(7)]) == [where]
        at = ring._index_at + _slot_of(key(7), ring.slots) * SLOT_BYTES
        sequence = struct.unpack_from("<Q", ring._map, at)[0]
        assert sequence % 2 == 0 and sequence > 0
        struct.pack_into("<Q", ring._map, at, sequence + 1)  # mid-write
        assert reader.find([key(7)]) is None
        struct.pack_into("<Q", ring._map, at, sequence + 2)
        assert reader.find([key(7)]) == [where]
        struct.pack_into("<d", ring._map, _BEAT, time.monotonic() - FRESH_S - 1)
        assert reader.find([key(7)]) is None
        ring.beat()
        assert reader.find([key(7)]) == [where]


def test_put_rings_carry_no_index_and_the_index_stays_a_small_part_of_the_segment():
    with mapped(index=False) as (put_ring, reader):
        put_ring.place(b"p" * 100, key(1))
        assert reader.slots == 0 and reader.find([key(1)]) is None
    for size in (2**20, 64 << 20, 256 << 20, 4 << 30):
        slots = index_slots_for(size)
        assert slots & (slots - 1) == 0 and slots * SLOT_BYTES <= max(size // 64, 256 * SLOT_BYTES)


def test_a_same_host_lookup_of_pages_in_the_ring_makes_no_rpc_and_the_load_reads_them_in_place():
    items = pages(6, seed=20)
    keys = [k for k, _ in items]
    unknown = pages(1, seed=21)[0][0]
    with StoreProcess(["--no-disk"]) as store:
        tier = RemoteTier([store.address])
        try:
            tier.put(items)  # placed in the ring at Put time
            tier.warm()  # maps the ring
            client = tier.servers[0].client
            before = lookups(store.address)
            assert tier.contains(keys) == [True] * len(keys)
            assert tier.contains_prefix(keys[:3]) == 3
            assert client.ring_lookups == 2 and lookups(store.address) == before + 1  # only the Stats call
            assert tier.get(keys) == [b for _, b in items] and tier.pages_from_lookup == len(keys)
            # A key the ring does not hold: the server is asked, and says it is not held.
            before = lookups(store.address)
            assert tier.contains([*keys, unknown]) == [True] * len(keys) + [False]
            assert tier.contains_prefix([*keys[:2], unknown, keys[2]]) == 2
            assert client.ring_lookups == 2 and lookups(store.address) == before + 3
            assert tier.stats().corrupt == 0
        finally:
            tier.close()


def test_a_dead_servers_ring_answers_no_lookup_from_the_moment_it_dies():
    items = pages(4, seed=22)
    keys = [k for k, _ in items]
    store = StoreProcess(["--no-disk"])
    store.start()
    tier = RemoteTier([store.address], timeout_s=1.0)
    try:
        tier.put(items)
        tier.warm()
        assert tier.contains(keys) == [True] * len(keys)
        assert tier.servers[0].client.ring_lookups == 1
        reader = tier.servers[0].client.ring_reader
        assert reader is not None and reader.server_alive()
        store.kill()  # its memory stays mapped here, with every page still in it, its heartbeat fresh
        assert not reader.server_alive() and time.monotonic() - reader.heartbeat() < FRESH_S
        assert tier.contains(keys) == [False] * len(keys)  # asked by RPC: down, a miss
        assert tier.servers[0].client.ring_lookups == 1 and tier.stats().errors >= 1
        # Refs of the first Lookup still point into the dead server's memory: verified bytes or a miss.
        assert all(b is None or b == blob for b, (_, blob) in zip(tier.get(keys), items, strict=True))
        assert tier.stats().corrupt == 0
    finally:
        tier.close()
        store.stop()
