"""A reader's map of an arena is faulted in as far as the server has written, off the request
path (shm/read_ahead.py): measured by the reader's own mapping in /proc/self/smaps (pages mapped
in that range of this process), not by the thread's counters."""

from __future__ import annotations

import pytest
from test_prefault import _populate_offered, wait_for

from tiered_cache.shm.arena import Arena
from tiered_cache.shm.arena_map import ArenaMap

MIB = 2**20
pytestmark = pytest.mark.skipif(not _populate_offered(), reason="no MADV_POPULATE (Linux 5.14+)")


def mapped_bytes(address: int) -> int:
    """Rss of the mapping that starts at `address` in this process."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                inside = int(first.split("-")[0], 16) == address
            elif inside and first == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_new_map_is_faulted_in_up_to_the_head_and_follows_later_writes():
    arena = Arena(16 * MIB, lease_s=0)
    try:
        arena.put([(i.to_bytes(32, "little"), bytes([i]) * MIB) for i in range(4)])  # ~4 MiB written
        reader = ArenaMap(arena.path, arena.size, arena.id)
        try:
            address = reader.address()
            index = reader.size - reader.index_at
            assert wait_for(lambda: mapped_bytes(address) >= 4 * MIB + index)
            # Nothing past the head: the rest of the data is not the reader's to commit.
            assert mapped_bytes(address) < 6 * MIB + index
            arena.put([(i.to_bytes(32, "little"), bytes([i]) * MIB) for i in range(4, 10)])  # ~10 MiB now
            assert wait_for(lambda: mapped_bytes(address) >= 10 * MIB + index)
            assert reader.read(*arena.refs([(7).to_bytes(32, "little")], lease=False)[0]) == bytes([7]) * MIB
        finally:
            reader.close()
        assert not reader._read_ahead.is_alive() or wait_for(lambda: not reader._read_ahead.is_alive(), 2.0)
    finally:
        arena.close()


def test_a_range_that_wraps_round_the_ring_is_faulted_in_two_pieces():
    from tiered_cache.shm.read_ahead import ReadAhead

    owner = type("Owner", (), {})()
    ahead = ReadAhead(owner, address=1 << 20, head_at=40, data_at=4096, capacity=1000, extra=(0, 0),
                      closed=lambda _: False)
    calls: list[tuple[int, int]] = []
    ahead._advise = lambda offset, length: (calls.append((offset, length)), True)[1]
    assert ahead._advise_ring(900, 1050)  # 100 bytes to the ring's end, then 50 from its start
    assert calls == [(4096 + 900, 100), (4096, 50)]
    calls.clear()
    assert ahead._advise_ring(2100, 2200) and calls == [(4096 + 100, 100)]


def test_what_was_written_before_the_map_is_faulted_in_newest_first_and_only_what_the_ring_holds(monkeypatch):
    import struct

    from tiered_cache.shm import read_ahead
    from tiered_cache.shm.read_ahead import ReadAhead

    class Owner:
        raw = bytearray(64)

    monkeypatch.setattr(read_ahead, "_CHUNK_BYTES", 300)
    owner = Owner()
    struct.pack_into("<Q", owner.raw, 40, 1500)  # the head: 1,500 bytes written into a ring of 1,000
    ahead = ReadAhead(owner, address=0, head_at=40, data_at=4096, capacity=1000, extra=(8, 16),
                      closed=lambda _: False)
    spans: list[tuple[int, int]] = []

    def advise(offset: int, length: int) -> bool:
        spans.append((offset, length))
        if sum(n for o, n in spans if o >= 4096) >= 1000:  # the whole ring: done
            ahead._stopping.set()
        return True

    ahead._advise = advise
    ahead.run()
    assert spans[0] == (8, 16)  # the index, once
    # Positions 1,200-1,500 (offsets 200-500) first, then 900-1,200 (400-500 and 0-200 round the
    # ring's end), then 600-900, then 500-600: the newest first, nothing older than the ring holds.
    assert spans[1:] == [(4096 + 200, 300), (4096 + 900, 100), (4096, 200), (4096 + 600, 300), (4096 + 500, 100)]


def test_a_page_the_read_ahead_has_not_reached_is_mapped_in_one_call_before_it_is_read(monkeypatch):
    from tiered_cache.shm import read_ahead
    from tiered_cache.shm.read_ahead import MADV_POPULATE_READ, ReadAhead

    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(read_ahead, "madvise",
                        lambda address, length, advice: (calls.append((address, length, advice)), True)[1])
    owner = type("Owner", (), {})()
    ahead = ReadAhead(owner, address=1 << 20, head_at=40, data_at=4096, capacity=1000, extra=(0, 0),
                      closed=lambda _: False)
    ahead.fault_in(100, 50)
    assert calls == []  # not known yet whether the kernel offers it: left to fault in
    ahead._offered, ahead.mapped_from, ahead.mapped_to = True, 1200, 1500
    ahead.fault_in(1300, 100)  # mapped already
    assert calls == []
    ahead.fault_in(1100, 150)  # partly before what is mapped: positions 1,100-1,250 are offsets 100-250
    assert calls == [((1 << 20) + 4096 + 100, 150, MADV_POPULATE_READ)]
    calls.clear()
    ahead.fault_in(1950, 100)  # would cross the ring's end: left to fault in
    assert calls == []


def test_a_view_of_a_page_the_read_ahead_has_not_reached_maps_it_and_reads_it_right():
    arena = Arena(16 * MIB, lease_s=0)
    try:
        reader = ArenaMap(arena.path, arena.size, arena.id)  # nothing written yet: nothing to map
        try:
            ahead = reader._read_ahead
            ahead.stop()  # as if it had stepped aside for a request
            ahead._offered, ahead.mapped_from, ahead.mapped_to = True, 0, 0
            arena.put([(i.to_bytes(32, "little"), bytes([i]) * MIB) for i in range(4)])
            address, index = reader.address(), reader.size - reader.index_at
            before = mapped_bytes(address)
            assert before < MIB + index  # the data is not mapped yet
            position, length = arena.refs([(2).to_bytes(32, "little")], lease=False)[0]
            ahead._stopping.clear()  # open again: a view may map it now
            view = reader.view(position, length)
            assert mapped_bytes(address) >= before + length  # mapped by the view, before any byte is read
            assert view is not None and bytes(view) == bytes([2]) * MIB
        finally:
            reader.close()
    finally:
        arena.close()
