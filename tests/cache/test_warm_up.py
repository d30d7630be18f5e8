"""A new cache opens what its first load would otherwise pay for, in the background: the lower
tiers' threads and connections (a real disk tier, a real store server in another process, a
Redis), the prefetch threads; a tier that fails to warm up is left to open on first use."""

from __future__ import annotations

import threading

import pytest
import torch
from kv_oracle import token_kv

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.ram import RamTier

SPEC = KVSpec("warm-up-test", 2, 2, 8, dtype=DType.FP32, page_size=4)


def threads_named(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def test_disk_readers_and_prefetch_threads_start_with_the_cache(tmp_path):
    before = threads_named("disk-tier-read"), threads_named("tiered-cache-prefetch")
    config = CacheConfig(pool_capacity="64KiB", host_capacity="64KiB", lower_tiers="disk",
                         disk_path=str(tmp_path / "disk"), malloc_tuning=False)
    cache = TieredCache(SPEC, config)
    try:
        cache.warming.join(10)
        assert threads_named("disk-tier-read") > before[0]
        assert threads_named("tiered-cache-prefetch") > before[1]
    finally:
        cache.close()


def test_a_store_server_is_connected_and_mapped_before_the_first_request():
    with StoreProcess(["--no-disk", "--ram", "64MiB"]) as store:
        config = CacheConfig(pool_capacity="64KiB", host_capacity="64KiB", lower_tiers="remote",
                             remote_addresses=store.address, malloc_tuning=False, write_policy="write_through")
        cache = TieredCache(SPEC, config)
        try:
            cache.warming.join(30)
            remote = cache.chain.tiers[0]
            assert remote.same_host  # the arena is mapped: a load reads pages in place from the start
            tokens = list(range(16))
            cache.put(tokens, token_kv(SPEC, tokens))
            cache.flush()
            assert remote.contains_prefix(cache.core.keys("", tokens)) == 4
        finally:
            cache.close()


class RefusingTier(RamTier):
    def warm(self) -> None:
        raise ConnectionError("down")


def test_a_tier_that_fails_to_warm_up_is_skipped_and_the_next_warms():
    warmed = []

    class Counting(RamTier):
        def warm(self) -> None:
            warmed.append(True)

    chain = TierChain([RefusingTier(1 << 16), Counting(1 << 16)])
    chain.warm()
    assert warmed == [True]
    chain.put([(b"k" * 32, b"v")], 0)
    assert chain.locate([b"k" * 32]) == [0]


def test_the_warm_up_returns_once_the_tiers_are_open_and_never_later_than_its_bound():
    import time

    from tiered_cache.cache.warm_up import warm_up_async

    loads = type("NoLoads", (), {"warm": lambda self: None})()
    warmed: list[bool] = []

    class Slow(RamTier):
        def warm(self) -> None:  # a connection that takes a while
            time.sleep(0.3)
            warmed.append(True)

    thread = warm_up_async(TierChain([Slow(1 << 16)]), loads)
    assert warmed == [True]  # open when it returned: a request made then does not open it

    release = threading.Event()

    class Stuck(RamTier):
        def warm(self) -> None:  # a server that does not answer
            release.wait(30)

    started = time.monotonic()
    thread = warm_up_async(TierChain([Stuck(1 << 16)]), loads, open_wait_s=0.2)
    assert time.monotonic() - started < 5 and thread.is_alive()  # the constructor goes on; the tier opens later
    release.set()
    thread.join(10)
    assert not thread.is_alive()


def test_the_pool_is_faulted_in_page_range_by_page_range_across_its_blocks(monkeypatch):
    import tiered_cache.device.memory as memory

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(memory, "_populate", lambda address, length: (calls.append((address, length)), True)[1])
    tensor = torch.empty(2, 4, 8 * 1024, dtype=torch.uint8)  # 8 blocks of 8 KiB
    thread = memory.PretouchThread(tensor, chunk_bytes=8 * 4096, blocks=8)
    calls.clear()  # the probe in the constructor
    thread.run()
    base, block = tensor.data_ptr(), 8 * 1024
    assert {(a, n) for a, n in calls} == {(base + b * block + s, 4096) for b in range(8) for s in (0, 4096)}
    # The first page range of every block comes before the second range of any block.
    first = [i for i, (a, _) in enumerate(calls) if (a - base) % block == 0]
    assert max(first) < min(i for i, (a, _) in enumerate(calls) if (a - base) % block == 4096)


@pytest.mark.parametrize("huge", [4096, 1 << 30])
def test_the_pool_pretouch_steps_aside_before_each_blocks_range_that_reaches_a_new_huge_page(monkeypatch, huge):
    # A range's first populate faults a whole huge page in each block: one step across all blocks
    # is blocks x 2 MiB, so the thread looks for a request before each block's range that reaches
    # a huge page not touched yet (here: every range with 4 KiB "huge pages"), else not at all.
    import tiered_cache.device.memory as memory

    events: list[object] = []
    monkeypatch.setattr(memory, "_populate", lambda address, length: (events.append(address), True)[1])
    monkeypatch.setattr(memory, "_HUGE_PAGE", huge)
    tensor = torch.empty(2, 4, 8 * 1024 + 4096, dtype=torch.uint8)  # 8 blocks of 12 KiB
    thread = memory.PretouchThread(tensor, chunk_bytes=8 * 4096, blocks=8)
    events.clear()
    thread.yield_to = lambda: events.append("step")
    thread.run()
    ranges = [e for e in events if e != "step"]
    assert len(ranges) == 8 * 3
    steps = events.count("step")
    if huge == 4096:
        assert steps == len(ranges) and events[0::2] == ["step"] * len(ranges)  # a step before each
    else:
        # 1 GiB "huge pages": a step only where a range enters a new one (the tensor crosses at
        # most one boundary), not before every range.
        assert steps <= 1


def test_an_arena_maps_read_ahead_steps_aside_while_any_cache_of_the_process_serves_a_request(monkeypatch):
    import struct

    import tiered_cache.cache.warm_up as warm_up
    from tiered_cache.cache.foreground import PROCESS, Foreground
    from tiered_cache.shm import read_ahead

    monkeypatch.setattr(warm_up, "_YIELD_S", 0.01)
    monkeypatch.setattr(read_ahead, "step_aside", None)
    loads = type("NoLoads", (), {"warm": lambda self: None})()
    warm_up.warm_up_async(TierChain([]), loads).join(10)  # any cache's warm-up installs the hook
    hook = read_ahead.step_aside
    assert hook is not None
    waits: list[bool] = []  # per chunk: whether a request was still running when its wait ended
    monkeypatch.setattr(read_ahead, "step_aside", lambda: waits.append((hook(), not PROCESS.wait_idle(0))[1]))
    monkeypatch.setattr(read_ahead, "_CHUNK_BYTES", 250)

    class Owner:
        raw = bytearray(64)

    def run_read_ahead() -> int:
        owner = Owner()
        struct.pack_into("<Q", owner.raw, 40, 1000)  # a full ring of 1,000 bytes written
        ahead = read_ahead.ReadAhead(owner, address=0, head_at=40, data_at=4096, capacity=1000, extra=(8, 16),
                                     closed=lambda _: False)
        advised: list[int] = []

        def advise(offset: int, length: int) -> bool:
            advised.append(length)
            if sum(advised[1:]) >= 1000:
                ahead._stopping.set()
            return True

        ahead._advise = advise
        ahead.run()
        return len(advised) - 1  # the data chunks (the index is not waited for)

    other_cache = Foreground(PROCESS)  # a request of another cache in this process
    with other_cache:
        chunks = run_read_ahead()
    assert chunks == 4 and waits == [True] * 4  # each chunk waited for the request
    waits.clear()
    assert run_read_ahead() == 4 and waits == [False] * 4  # no request: no wait


def test_a_new_caches_pretouch_steps_aside_while_a_request_runs():
    import tiered_cache.device.memory as memory
    from tiered_cache.cache.foreground import Foreground
    from tiered_cache.cache.warm_up import warm_up_async

    tensor = torch.empty(4 * 4096 * 2, dtype=torch.uint8)
    thread = memory.PretouchThread(tensor, chunk_bytes=4 * 4096)
    if not thread.preserves_bytes:
        return  # no MADV_POPULATE_WRITE here: the thread writes zeros, and a request may wait for it instead
    foreground = Foreground()
    waits: list[bool] = []  # per chunk: whether the request was still running when the wait ended
    chain = TierChain([])
    with foreground:  # a request in progress the whole time: every chunk waits for it, briefly
        loads = type("NoLoads", (), {"warm": lambda self: None})()
        warm_up_async(chain, loads, [thread], foreground)
        real = thread.yield_to
        thread.yield_to = lambda: waits.append(not real())  # wait_idle: False when it timed out busy
        thread.start()
        thread.join(30)
    assert waits == [True, True]  # before each chunk of 4 OS pages, it waited for the request



def test_building_a_cache_ends_with_a_full_collection_at_most_once_a_minute(monkeypatch):
    """What building a cache left behind is collected by its constructor, not by the first
    request's allocations (a full collection holds the GIL for 0.05-0.1 s) nor by a background
    thread beside the first loads' measurements; a second cache built within the minute does not
    pay for it again (a test suite builds hundreds)."""
    import gc

    import tiered_cache.cache.warm_up as warm_up

    monkeypatch.setattr(warm_up, "_collected_at", None)  # as in a new process
    building = threading.Event()
    full: list[bool] = []  # per oldest-generation collection: whether a cache was being built

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(building.is_set())

    config = CacheConfig(pool_capacity="64KiB", host_capacity="64KiB", malloc_tuning=False)
    caches = []
    gc.callbacks.append(on_gc)
    try:
        for _ in range(2):
            building.set()
            caches.append(TieredCache(SPEC, config))
            building.clear()
            if len(caches) == 1:
                assert full and full[-1]  # the last full collection ran inside the first constructor
                full.clear()
    finally:
        gc.callbacks.remove(on_gc)
        for cache in caches:
            cache.close()
    assert not any(full)  # none inside the second
