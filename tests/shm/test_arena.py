"""The arena on its own (shm/arena.py, shm/arena_map.py): placement, the order of eviction with its
second chance, leases, the tail that tells a reader its copy is intact, and the seals that keep
another process from writing or shrinking it. Integrity is checked after every step."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tiered_cache.server.config import ServerConfig
from tiered_cache.shm.arena import DATA, MIN_CAPACITY, Arena, bucket_of
from tiered_cache.shm.arena_map import ArenaMap

BLOB = 100_000  # ten of them fill a 1 MiB arena


def blobs(n: int, start: int = 0) -> list[tuple[bytes, bytes]]:
    return [(i.to_bytes(32, "little"), bytes([i % 251]) * BLOB) for i in range(start, start + n)]


class Below:
    """What the arena sends to the tier below, in order."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.items: dict[bytes, bytes] = {}

    def __call__(self, items: list[tuple[bytes, bytes]]) -> None:
        self.keys += [k for k, _ in items]
        self.items.update(items)


@pytest.fixture
def arena():
    below = Below()
    arena = Arena(MIN_CAPACITY, on_evict=below, lease_s=0)
    arena.below = below
    yield arena
    arena.close()


def test_blobs_put_are_read_back_in_place_by_a_read_only_map(arena):
    items = blobs(5)
    assert arena.put(items) == 5
    arena.check()
    reader = ArenaMap(arena.path, arena.size, arena.id)
    try:
        refs = arena.refs([k for k, _ in items])
        assert [reader.read(*ref) for ref in refs] == [b for _, b in items]
        assert arena.refs([b"\x00" * 31 + b"\x01"]) == [None]
        assert arena.get([items[2][0]]) == [items[2][1]]
        assert arena.put(items[:2]) == 0  # held already: not placed twice
        arena.check()
    finally:
        reader.close()


def test_the_oldest_blob_goes_below_first_and_a_read_one_gets_a_second_chance(arena):
    first = blobs(10)
    arena.put(first)
    arena.refs([first[0][0]])  # read: survives the next lap once
    arena.put(blobs(3, start=10))
    arena.check()
    held = arena.contains([k for k, _ in first])
    assert held[0] and not any(held[1:4]) and all(held[4:])
    assert arena.below.keys == [k for k, _ in first[1:4]]  # in order, with their bytes
    assert all(arena.below.items[k] == b for k, b in first[1:4])
    assert arena.second_chances == 1
    arena.put(blobs(10, start=20))  # a full lap more: no read since, so it goes too
    arena.check()
    assert not arena.contains([first[0][0]])[0] and arena.below.items[first[0][0]] == first[0][1]


def test_a_blob_the_head_writes_over_is_not_intact_for_a_reader_holding_its_ref(arena):
    reader = ArenaMap(arena.path, arena.size, arena.id)
    try:
        arena.put(blobs(1))
        ref = arena.refs([blobs(1)[0][0]], lease=False)[0]
        view = reader.view(*ref)
        assert view is not None and reader.intact(*ref)
        arena.put(blobs(10, start=1))  # read once, so placed again, then erased on the next lap
        arena.put(blobs(10, start=11))
        arena.check()
        assert not reader.intact(*ref) and reader.read(*ref) is None and reader.view(*ref) is None
        del view
    finally:
        reader.close()


def test_a_leased_blob_is_not_written_over_until_its_lease_ends():
    below = Below()
    arena = Arena(MIN_CAPACITY, on_evict=below, lease_s=0.2)
    try:
        items = blobs(10)
        arena.put(items)
        arena.refs([items[0][0]])  # leased: the head may not pass it
        newer = blobs(2, start=10)
        assert arena.put(newer) == 0 and arena.lease_blocked == 2
        assert below.keys == [k for k, _ in newer]  # sent below instead, bytes intact
        assert all(arena.contains([k for k, _ in items]))
        arena.check()
        time.sleep(0.3)  # the lease has ended (a bound, not a race: nothing renews it)
        assert arena.put(blobs(2, start=12)) == 2
        arena.check()
    finally:
        arena.close()


def test_a_blob_too_large_for_the_arena_goes_below_and_nothing_is_lost(arena):
    big = (b"b" * 32, b"x" * (arena.max_blob + 1))
    assert arena.put([big]) == 0 and arena.below.items == {big[0]: big[1]}
    arena.check()


def test_deleted_keys_are_forgotten_but_refs_out_there_stay_readable_until_written_over(arena):
    reader = ArenaMap(arena.path, arena.size, arena.id)
    try:
        items = blobs(3)
        arena.put(items)
        ref = arena.refs([items[1][0]])[0]
        arena.delete([items[1][0]])
        arena.check()
        assert arena.contains([k for k, _ in items]) == [True, False, True]
        assert reader.read(*ref) == items[1][1]
    finally:
        reader.close()


def test_a_map_of_another_arena_or_size_is_refused_by_name(arena):
    with pytest.raises(ValueError, match="not the arena"):
        ArenaMap(arena.path, arena.size, os.urandom(16))
    with pytest.raises(ValueError, match="segment named"):
        ArenaMap(arena.path, arena.size + 4096, arena.id)
    unsealed = os.memfd_create("tiered-cache-arena", os.MFD_CLOEXEC)
    try:
        os.ftruncate(unsealed, arena.size)
        with pytest.raises(ValueError, match="not sealed"):
            ArenaMap(f"/proc/{os.getpid()}/fd/{unsealed}", arena.size, arena.id)
    finally:
        os.close(unsealed)
    with pytest.raises(ValueError, match="at least"):
        Arena(MIN_CAPACITY - 1)


HOSTILE = """
import mmap, os, sys
path, size = sys.argv[1], int(sys.argv[2])
done = []
for name, attempt in [
    ("write", lambda: os.write(os.open(path, os.O_WRONLY), b"garbage")),
    ("truncate", lambda: os.truncate(path, 4096)),
    ("grow", lambda: os.truncate(path, size * 2)),
    ("map for writing", lambda: mmap.mmap(os.open(path, os.O_RDWR), size)),
]:
    try:
        attempt()
        done.append(name)
    except OSError:
        pass
print(",".join(done))
"""


def test_another_process_of_the_same_user_can_neither_write_nor_resize_the_arena(arena):
    """A hostile process handed the arena's path (a real process, as the same user)."""
    items = blobs(3)
    arena.put(items)
    result = subprocess.run([sys.executable, "-c", HOSTILE, arena.path, str(arena.size)],
                            capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "", f"the hostile process could: {result.stdout.strip()}"
    reader = ArenaMap(arena.path, arena.size, arena.id)
    try:
        assert [reader.read(*ref) for ref in arena.refs([k for k, _ in items])] == [b for _, b in items]
        assert os.fstat(arena.fd).st_size == arena.size == DATA + arena.capacity + arena.buckets * 64
    finally:
        reader.close()


def test_shm_takes_on_or_off_and_a_size_is_refused_by_name():
    assert ServerConfig(shm="off", disk_path="").shm is False
    assert ServerConfig(shm="on", disk_path="").shm is True
    with pytest.raises(ValueError, match=r"shm: expected on or off.*ram_capacity"):
        ServerConfig(shm="256MiB", disk_path="")
    with pytest.raises(ValueError, match="arena_lease_s"):
        ServerConfig(arena_lease_s=-1, disk_path="")


def test_the_published_index_says_where_pages_lie_until_they_are_written_over(arena):
    reader = ArenaMap(arena.path, arena.size, arena.id)
    try:
        items = blobs(3)
        arena.put(items)
        keys = [k for k, _ in items]
        assert reader.find(keys) == arena.refs(keys, lease=False)
        assert reader.find([*keys, b"\x07" * 32]) is None  # one key it lacks: ask the server
        same_bucket = next(k for i in range(1, 10**6) if bucket_of(k := i.to_bytes(32, "little"), arena.buckets)
                         == bucket_of(keys[0], arena.buckets) and k != keys[0])
        arena.put([(same_bucket, b"s" * BLOB)])  # takes keys[0]'s bucket
        assert reader.find(keys) is None and reader.find(keys[1:]) == arena.refs(keys[1:], lease=False)
        arena.put(blobs(20, start=100))  # a lap and more: all written over
        arena.check()
        assert reader.find(keys[1:]) is None
    finally:
        reader.close()


def test_a_deleted_page_leaves_the_published_index(arena):
    reader = ArenaMap(arena.path, arena.size, arena.id)
    try:
        items = blobs(2)
        arena.put(items)
        keys = [k for k, _ in items]
        assert reader.find(keys) is not None
        arena.delete(keys[:1])
        arena.check()
        assert reader.find(keys[:1]) is None and reader.find(keys[1:]) == arena.refs(keys[1:], lease=False)
    finally:
        reader.close()
