"""The prefault thread (shm/advice.py): memory just past a log's write head is faulted in ahead of
the writes, never more than its window ahead, without changing a byte, and the thread never keeps
its owner's map alive. What is faulted in is read from the memfd itself (`st_blocks`: the shared
memory the kernel has allocated for it), not from the thread's own counters."""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import time
from collections.abc import Callable, Iterator

import pytest

from tiered_cache.shm.advice import Prefault, map_address, populate
from tiered_cache.shm.arena import Arena
from tiered_cache.shm.host import sealed_segment
from tiered_cache.shm.put_ring import HEADER, PutRing

MIB = 2**20

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux-only")


def _populate_offered() -> bool:
    fd, mapped = sealed_segment("probe", MIB)
    try:
        return populate(map_address(mapped), 4096)
    finally:
        mapped.close()
        os.close(fd)


needs_populate = pytest.mark.skipif(not _populate_offered(), reason="no MADV_POPULATE_WRITE (Linux 5.14+)")


class Log:
    """A writer as the thread sees it: where its writes have reached."""

    def __init__(self) -> None:
        self.head = 0

    def written(self) -> int:
        return self.head


def allocated(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


@contextlib.contextmanager
def prefaulting(size: int, ahead: int) -> Iterator[tuple[int, mmap.mmap, Log, Prefault]]:
    """A fresh segment of `size` bytes written by a `Log`, its prefault thread running (1 MiB
    chunks); stopped, unmapped and closed after."""
    fd, mapped = sealed_segment("log", size)
    log = Log()
    thread = Prefault(mapped, log, Log.written, ahead=ahead, chunk_bytes=MIB)
    thread.start()
    try:
        yield fd, mapped, log, thread
    finally:
        thread.stop()
        mapped.close()
        os.close(fd)


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@needs_populate
def test_faults_in_its_window_past_the_writes_and_no_further() -> None:
    with prefaulting(64 * MIB, ahead=8 * MIB) as (fd, mapped, log, thread):
        time.sleep(1.5)  # past the thread's idle look at its owner
        assert allocated(fd) == 0  # nothing before the first write: an idle log commits nothing
        mapped[:MIB] = b"\1" * MIB
        log.head = MIB
        thread.nudge()
        assert wait_for(lambda: allocated(fd) >= 9 * MIB)
        time.sleep(0.2)
        assert allocated(fd) <= 9 * MIB + 2 * MIB  # the window, not the map (huge pages may round up)
        log.head = 40 * MIB  # the writer ran ahead on its own: the thread skips what it wrote
        thread.nudge()
        assert wait_for(lambda: thread.faulted >= 48 * MIB)
        assert allocated(fd) <= 9 * MIB + 8 * MIB + 2 * MIB  # the 31 MiB the writer skipped are not faulted
        log.head = 64 * MIB
        thread.nudge()
        thread.join(10)
        assert not thread.is_alive()  # the whole map was written: nothing left to do


@needs_populate
def test_changes_no_byte_while_the_owner_writes() -> None:
    with prefaulting(32 * MIB, ahead=32 * MIB) as (_, mapped, log, thread):
        for i in range(32):  # one MiB at a time, each ahead of or inside the thread's window
            mapped[i * MIB:(i + 1) * MIB] = bytes([i + 1]) * MIB
            log.head = (i + 1) * MIB if i % 2 else i * MIB  # sometimes behind what was written
            thread.nudge()
        thread.nudge()
        time.sleep(0.3)
        assert all(mapped[i * MIB:(i + 1) * MIB] == bytes([i + 1]) * MIB for i in range(32))


def test_stop_ends_it_at_once_and_an_unused_one_too() -> None:
    fd, mapped = sealed_segment("log", 8 * MIB)
    log = Log()
    thread = Prefault(mapped, log, Log.written)
    thread.start()
    started = time.monotonic()
    thread.stop()
    assert not thread.is_alive() and time.monotonic() - started < 1.0
    mapped.close()  # no export of the map is left open
    os.close(fd)


def test_a_put_ring_dropped_unclosed_is_not_kept_alive_by_its_thread() -> None:
    ring = PutRing(4 * MIB)
    thread = ring._prefault
    fd = ring.fd
    del ring
    gc.collect()
    assert wait_for(lambda: not thread.is_alive(), 5.0)  # it saw its owner go
    os.close(fd)


@needs_populate
def test_the_arena_and_a_put_ring_fault_ahead_of_their_writes() -> None:
    arena = Arena(64 * MIB)
    try:
        before = allocated(arena.fd)
        arena.put([(b"k" * 32, b"\7" * MIB)])
        # the page written, then the thread's window past it (a sixteenth of the map, at least 16 MiB)
        assert wait_for(lambda: allocated(arena.fd) >= before + 17 * MIB)
        time.sleep(0.2)
        assert allocated(arena.fd) <= before + 17 * MIB + 2 * MIB  # and no further
        assert arena.get([b"k" * 32]) == [b"\7" * MIB]
    finally:
        arena.close()
    ring = PutRing(32 * MIB)
    try:
        assert allocated(ring.fd) <= HEADER + 4096  # nothing placed yet
        assert ring.place(b"\5" * MIB) is not None
        assert wait_for(lambda: allocated(ring.fd) >= 16 * MIB)
    finally:
        ring.close()
