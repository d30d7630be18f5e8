"""Registering arena maps with CUDA once per process (device/arena_registry.py): the bookkeeping,
on the CPU, with the runtime's two calls recorded (there is no GPU to refuse or accept them here:
the `gpu` tests in test_arena_copy.py run the real ones), against real arena maps."""

from __future__ import annotations

import gc
import weakref

import pytest

from tiered_cache.device.arena_registry import ALREADY_REGISTERED, ArenaRegistry
from tiered_cache.shm.arena import Arena
from tiered_cache.shm.arena_map import ArenaMap


class Runtime:
    """What the registry asked of the runtime, and what it answers to the next registrations."""

    def __init__(self) -> None:
        self.asked: list[int] = []  # every registration asked for, answered or refused
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.answers: list[int] = []
        self.errors_read = 0

    def registry(self) -> ArenaRegistry:
        return ArenaRegistry(self.register, self.unregister, self.forget)

    def register(self, address: int, size: int) -> int:
        assert size > 0
        self.asked.append(address)
        answer = self.answers.pop(0) if self.answers else 0
        if not answer:
            self.registered.append(address)
        return answer

    def unregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 0

    def forget(self) -> None:
        self.errors_read += 1


@pytest.fixture
def arena():
    made = Arena(8 * 2**20)
    yield made
    made.close()


def test_a_map_is_registered_once_whoever_asks_and_unregistered_when_closed(arena: Arena) -> None:
    runtime = Runtime()
    registry = runtime.registry()
    reader = ArenaMap(arena.path, arena.size, arena.id)
    address = reader.address()
    assert registry.ensure(reader) == 0 and registry.ensure(reader) == 0  # two caches reading one store
    assert runtime.registered == [address] and registry.held(reader) and len(registry) == 1
    reader.close()
    assert runtime.unregistered == [address] and len(registry) == 0  # before the unmap, once


def test_a_map_dropped_without_close_is_unregistered_when_collected(arena: Arena) -> None:
    runtime = Runtime()
    registry = runtime.registry()
    reader = ArenaMap(arena.path, arena.size, arena.id)
    address = reader.address()
    assert registry.ensure(reader) == 0
    del reader  # a client whose server restarted leaves its old map to the collector
    gc.collect()
    assert runtime.unregistered == [address] and len(registry) == 0


def test_a_refusal_is_returned_its_error_read_off_and_remembered_until_the_retry_time(arena: Arena) -> None:
    """Loads from a map the driver will not take stage their pages; they must not each ask the
    driver to pin the whole arena again. A refusal that may pass is asked again later."""
    from tiered_cache.device.arena_registry import RETRY_REFUSED_S

    runtime = Runtime()
    now = [100.0]
    registry = ArenaRegistry(runtime.register, runtime.unregister, runtime.forget, clock=lambda: now[0])
    reader = ArenaMap(arena.path, arena.size, arena.id)
    asked = runtime.asked
    runtime.answers = [801, 801]  # cudaErrorNotSupported, twice
    assert registry.ensure(reader) == 801
    assert runtime.errors_read == 1 and not registry.held(reader) and runtime.registered == []
    now[0] += RETRY_REFUSED_S - 1
    assert registry.ensure(reader) == 801 and len(asked) == 1  # remembered: the driver not asked again
    now[0] += 1
    assert registry.ensure(reader) == 801 and len(asked) == 2  # asked again once the time is up
    now[0] += RETRY_REFUSED_S
    assert registry.ensure(reader) == 0 and registry.held(reader) and len(asked) == 3
    hooks = len(reader._on_close)
    reader.close()
    assert len(runtime.unregistered) == 1 and hooks == 1  # one close() callback, however often asked


def test_a_refused_map_closing_is_not_asked_again(arena: Arena) -> None:
    runtime = Runtime()
    now = [0.0]
    registry = ArenaRegistry(runtime.register, runtime.unregister, runtime.forget, clock=lambda: now[0])
    reader = ArenaMap(arena.path, arena.size, arena.id)
    runtime.answers = [801]
    assert registry.ensure(reader) == 801
    reader.close()
    now[0] += 1e6
    assert registry.ensure(reader) == -1 and runtime.registered == [] and runtime.unregistered == []


def test_a_range_registered_already_is_not_trusted_and_not_undone(arena: Arena) -> None:
    """Someone else's registration, or one that outlived its map: the DMA could read other pages
    than the map holds, so the pages are staged instead."""
    runtime = Runtime()
    registry = runtime.registry()
    reader = ArenaMap(arena.path, arena.size, arena.id)
    runtime.answers = [ALREADY_REGISTERED]
    assert registry.ensure(reader) == ALREADY_REGISTERED and runtime.errors_read == 1
    assert not registry.held(reader)
    reader.close()
    assert runtime.unregistered == []  # not ours


def test_a_map_closing_already_is_not_registered(arena: Arena) -> None:
    runtime = Runtime()
    registry = runtime.registry()
    reader = ArenaMap(arena.path, arena.size, arena.id)
    reader.close()
    assert registry.ensure(reader) == -1 and runtime.registered == []


def test_a_collected_map_is_unregistered_on_the_registrys_thread_its_memory_held_till_then(arena: Arena) -> None:
    """Never inside a garbage collection on an engine's thread (a CUDA graph capture may be under
    way): the unregistration is queued, and the map's range stays mapped until it ran."""
    runtime = Runtime()
    queued: list = []
    registry = ArenaRegistry(runtime.register, runtime.unregister, runtime.forget, later=queued.append)
    reader = ArenaMap(arena.path, arena.size, arena.id)
    assert registry.ensure(reader) == 0
    memory = weakref.ref(reader.raw)
    del reader
    gc.collect()
    assert runtime.unregistered == [] and len(queued) == 1
    assert memory() is not None and not memory().closed  # still mapped: its address cannot be reused yet
    queued.pop()()
    gc.collect()
    assert len(runtime.unregistered) == 1 and memory() is None  # unregistered, then unmapped


def test_a_new_map_with_a_collected_ones_id_undoes_the_old_registration_first(arena: Arena) -> None:
    """id() reuse: a map collected unclosed (its release queued, not run yet), then a new map
    known by the same id asks. The old registration is undone then and there (its range must not
    stay registered once unmapped), and the old map's queued release leaves the new one's alone
    (unregistering it could pull the pages from under a DMA). The shared id is the one fake: the
    interpreter reuses ids, but not on cue."""
    runtime = Runtime()
    queued: list = []
    registry = ArenaRegistry(runtime.register, runtime.unregister, runtime.forget, later=queued.append)
    registry._key = lambda map_: 7
    old = ArenaMap(arena.path, arena.size, arena.id)
    old_address = old.address()
    assert registry.ensure(old) == 0
    del old
    gc.collect()
    assert len(queued) == 1 and runtime.unregistered == []
    new = ArenaMap(arena.path, arena.size, arena.id)
    new_address = new.address()
    assert new_address != old_address  # the old range is still mapped: held by the registry
    assert registry.ensure(new) == 0
    assert runtime.unregistered == [old_address] and registry.held(new)
    queued.pop()()  # the old map's release, late
    assert runtime.unregistered == [old_address] and registry.held(new) and len(registry) == 1
    new.close()
    assert runtime.unregistered == [old_address, new_address] and len(registry) == 0


def test_two_maps_of_two_arenas_each_their_own(arena: Arena) -> None:
    runtime = Runtime()
    registry = runtime.registry()
    other = Arena(8 * 2**20)
    try:
        first, second = ArenaMap(arena.path, arena.size, arena.id), ArenaMap(other.path, other.size, other.id)
        assert registry.ensure(first) == 0 and registry.ensure(second) == 0 and len(registry) == 2
        first.close()
        assert registry.held(second) and len(registry) == 1
        second.close()
        assert sorted(runtime.unregistered) == sorted(runtime.registered) and len(registry) == 0
    finally:
        other.close()


def test_maps_are_registered_ahead_as_they_are_mapped_until_closed(arena: Arena) -> None:
    """What a CUDA engine's cache runs from its start: maps mapped before and after it are
    registered on its own thread, before any load asks; none after `close`."""
    from tiered_cache.device.arena_registry import RegisterAhead

    runtime = Runtime()
    registry = runtime.registry()
    before = ArenaMap(arena.path, arena.size, arena.id)
    ahead = RegisterAhead(registry)
    after = ArenaMap(arena.path, arena.size, arena.id)  # a second map of the same arena: another range
    assert registry.held(before) and registry.held(after)  # (with any other test's map still open)
    addresses = {before.address(), after.address()}
    assert addresses <= set(runtime.registered)
    ahead.close()
    registered = len(runtime.registered)
    late = ArenaMap(arena.path, arena.size, arena.id)
    assert not registry.held(late) and len(runtime.registered) == registered
    for reader in (before, after, late):
        reader.close()
    assert addresses <= set(runtime.unregistered)
