"""`read_pages` (client/reads.py), the one place a store read picks its transport, against fake
servers: pages a Lookup found in a same-host arena are read there with no Get, the rest go by the
bulk Get where it serves, else by gRPC's Get; a broken stream keeps the pages it placed and its
error reaches the guard (the server's breaker)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import grpc
import pytest

from tiered_cache.client.get_streams import GetResult
from tiered_cache.client.reads import Transport, read_pages
from tiered_cache.shm.arena_map import ArenaViews
from tiered_cache.wire.framing import ReceivedBlob

PAGES = {bytes([i]) * 32: bytes([i]) * 100 for i in range(1, 5)}
KEYS = list(PAGES)


class FakeArena:
    """A server's arena as mapped here: every page of PAGES back to back; `overwritten` positions
    read as gone (the arena came round over them since the Lookup)."""

    def __init__(self, overwritten: frozenset[int] = frozenset()) -> None:
        self.data = b"".join(PAGES.values())
        self.overwritten = overwritten

    def ref(self, key: bytes) -> tuple[FakeArena, int, int]:
        return self, KEYS.index(key) * 100, 100

    def view(self, position: int, length: int) -> memoryview | None:
        return None if position in self.overwritten else memoryview(self.data)[position:position + length]

    def read(self, position: int, length: int) -> bytes | None:
        view = self.view(position, length)
        return None if view is None else bytes(view)


class FakeBulk:
    """A bulk Get that serves (True) or is refused before asking anything (False)."""

    def __init__(self, serves: bool) -> None:
        self.serves = serves
        self.asked: list[bytes] = []

    def get_into(self, keys: list[bytes], fingerprint: bytes, place: Any, budget_s: float | None) -> bool:
        if not self.serves:
            return False
        self.asked += keys
        for key in keys:
            place(key, memoryview(bytearray(PAGES[key]))).result()
        return True


class FakeClient:
    """A store client: its bulk Get (or none) and gRPC's Get, which stops after `breaks_after`
    pages with an error when set."""

    def __init__(self, bulk: FakeBulk | None = None, breaks_after: int | None = None) -> None:
        self._bulk = bulk
        self.breaks_after = breaks_after
        self.asked: list[bytes] = []

    def bulk(self) -> FakeBulk | None:
        return self._bulk

    def get_whole(self, keys: list[bytes], fingerprint: bytes, budget_s: float | None = None,
                  on_blob: Any = None, lease: ArenaViews | None = None) -> GetResult:
        self.asked += keys
        sent = keys if self.breaks_after is None else keys[:self.breaks_after]
        blobs = [ReceivedBlob(key, PAGES[key]) for key in sent]
        for blob in blobs:
            on_blob(blob)
        error = None if self.breaks_after is None else grpc.RpcError("the stream broke")
        return GetResult(blobs, error)


class Placed:
    """Places that keep what arrived, and how (one at a time or many at once, lent or not)."""

    def __init__(self) -> None:
        self.pages: dict[bytes, bytes] = {}
        self.how: dict[bytes, tuple[str, bool]] = {}

    def one(self, key: bytes, data: Any, lent: bool) -> Future[None]:
        self.pages[key], self.how[key] = bytes(data), ("one", lent)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def many(self, pages: list[tuple[bytes, Any]], lent: bool) -> None:
        for key, data in pages:
            self.pages[key], self.how[key] = bytes(data), ("many", lent)


def read(client: FakeClient, refs: dict[bytes, Any], lease: ArenaViews | None = None
         ) -> tuple[Transport, int, Placed, list[Exception]]:
    """`read_pages` of KEYS through a guard that, as a server's breaker does, counts an error
    and ends the call."""
    places, errors = Placed(), []

    def guard(get: Any) -> None:
        try:
            get(client)
        except grpc.RpcError as exc:
            errors.append(exc)

    transport, in_place = read_pages(client, KEYS, b"", places, refs=refs, lease=lease, budget_s=None, guard=guard)
    return transport, in_place, places, errors


@pytest.mark.parametrize("lent", [True, False])
def test_pages_a_lookup_found_in_an_arena_are_read_there_with_no_get(lent):
    arena = FakeArena()
    client = FakeClient(FakeBulk(serves=True))
    lease = ArenaViews() if lent else None
    transport, in_place, places, errors = read(client, {key: arena.ref(key) for key in KEYS}, lease)
    assert transport is Transport.ARENA and in_place == len(KEYS) and not errors
    assert places.pages == PAGES and set(places.how.values()) == {("many", lent)}
    assert client.asked == [] and client.bulk().asked == []  # no Get of either kind
    if lease is not None:
        assert all(lease.lent(key) for key in KEYS)


def test_the_rest_go_by_the_bulk_get_where_it_serves():
    arena = FakeArena()
    client = FakeClient(FakeBulk(serves=True))
    transport, in_place, places, _ = read(client, {KEYS[0]: arena.ref(KEYS[0])})
    assert transport is Transport.BULK and in_place == 1
    assert places.pages == PAGES and client.bulk().asked == KEYS[1:] and client.asked == []
    assert places.how[KEYS[1]] == ("one", False)


@pytest.mark.parametrize("bulk", [None, FakeBulk(serves=False)], ids=["no bulk Get", "bulk Get refused"])
def test_without_a_bulk_get_that_serves_grpc_gets_them(bulk):
    client = FakeClient(bulk)
    transport, in_place, places, errors = read(client, {})
    assert transport is Transport.GRPC and in_place == 0 and not errors
    assert places.pages == PAGES and client.asked == KEYS


def test_a_page_the_arena_wrote_over_since_its_lookup_is_asked_for_by_get():
    arena = FakeArena(overwritten=frozenset({100}))  # KEYS[1]'s place
    client = FakeClient()
    lease = ArenaViews()
    transport, in_place, places, _ = read(client, {key: arena.ref(key) for key in KEYS}, lease)
    assert transport is Transport.GRPC and in_place == len(KEYS) - 1 and client.asked == [KEYS[1]]
    assert places.pages == PAGES and places.how[KEYS[1]] == ("one", False) and not lease.lent(KEYS[1])


def test_a_broken_stream_keeps_the_pages_it_placed_and_its_error_reaches_the_guard():
    client = FakeClient(breaks_after=2)
    transport, _, places, errors = read(client, {})
    assert transport is Transport.GRPC and len(errors) == 1
    assert places.pages == {key: PAGES[key] for key in KEYS[:2]}


def test_a_server_whose_breaker_is_open_is_not_asked_but_its_arena_is_read():
    arena = FakeArena()
    client = FakeClient(FakeBulk(serves=True))
    places = Placed()
    transport, in_place = read_pages(client, KEYS, b"", places, refs={KEYS[0]: arena.ref(KEYS[0])}, lease=None,
                                     budget_s=None, guard=lambda get: None)  # the breaker refuses the call
    assert transport is None and in_place == 1 and places.pages == {KEYS[0]: PAGES[KEYS[0]]}
    assert client.asked == [] and client.bulk().asked == []
