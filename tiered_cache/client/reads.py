"""`read_pages`: one store server's share of a read, by the transport that fits, chosen here alone.

A page a Lookup found in the arena of a server on this host is read where it lies (`refs`): no
Get at all. The rest go by the bulk Get (pages as plain TCP bytes, for a server on another host
that offers it: `bulk_endpoint.py`), else by gRPC's Get, which answers a same-host client holding
a `lease` with refs into the arena (views) and anyone else with bytes. Whatever the transport,
each page goes to `places`, which say where it goes (a tier's destinations, verified there).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from tiered_cache.client.store_client import StoreClient
from tiered_cache.shm.arena_map import ArenaRef, ArenaViews


class Transport(enum.Enum):
    ARENA = "arena"  # every page read in place, no Get
    BULK = "bulk"
    GRPC = "grpc"


class Places(Protocol):
    """Where the pages of one read go."""

    def one(self, key: bytes, data: Any, lent: bool) -> Any:
        """A page as it arrives (`lent`: a view into an arena, good until written over). A bulk
        Get's page lies in a buffer reused for the next one: return a future that ends once
        `data` has been read (anything else for the other transports)."""

    def many(self, pages: list[tuple[bytes, Any]], lent: bool) -> None:
        """Pages read in place in an arena at once (views when `lent`, else copies)."""


Guard = Callable[[Callable[[StoreClient], None]], Any]  # runs a network call on the server (its breaker)


def read_pages(client: StoreClient, keys: list[bytes], fingerprint: bytes, places: Places, *,
               refs: Mapping[bytes, ArenaRef], lease: ArenaViews | None, budget_s: float | None,
               guard: Guard) -> tuple[Transport | None, int]:
    """Read `keys` (distinct, all of this server's) into `places`; returns how the pages not read
    in place went (ARENA: none were left; BULK: the bulk Get served them; GRPC: gRPC's Get was
    asked; None: neither, the server's breaker being open or the bulk Get failing midway), and
    how many were read in place. A ref the arena has written over since its Lookup is asked for
    like any other page. The network call runs through `guard` (the server's breaker: a failure
    is counted there and ends the read with the pages placed so far; an arena is read whatever
    the breaker says)."""
    in_place = _from_arena(keys, refs, lease)
    if in_place:
        places.many(in_place, lease is not None)
    done = {key for key, _ in in_place}
    rest = [key for key in keys if key not in done]
    if not rest:
        return Transport.ARENA, len(in_place)
    carried: list[Transport] = []

    def get(client: StoreClient) -> None:
        bulk = client.bulk()
        if bulk is not None and bulk.get_into(rest, fingerprint, lambda key, view: places.one(key, view, False),
                                              budget_s):
            carried.append(Transport.BULK)
            return
        carried.append(Transport.GRPC)
        result = client.get_whole(rest, fingerprint, budget_s=budget_s, lease=lease, on_blob=lambda item: places.one(
            item.key, item.blob, lease is not None and lease.lent(item.key)))
        if result.error is not None:  # pages received before the stream broke stay placed
            raise result.error

    guard(get)
    return (carried[0] if carried else None), len(in_place)


def _from_arena(keys: list[bytes], refs: Mapping[bytes, ArenaRef], lease: ArenaViews | None
                ) -> list[tuple[bytes, Any]]:
    """The pages of `keys` a Lookup placed in an arena, read there: lent as views recorded in
    `lease`, else copied out; one whose map closed meanwhile is skipped (asked for by Get)."""
    pages: list[tuple[bytes, Any]] = []
    for key in keys:
        ref = refs.get(key)
        if ref is None:
            continue
        reader, position, length = ref
        try:
            data = reader.view(position, length) if lease is not None else reader.read(position, length)
        except ValueError:  # that map was closed meanwhile (the client closed)
            data = None
        if data is None:
            continue
        if lease is not None:
            lease.add(key, reader, position, length)
        pages.append((key, data))
    return pages

