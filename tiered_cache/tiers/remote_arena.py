"""A `RemoteTier`'s reads from the arenas of store servers on this host.

A server on this host keeps its RAM tier in shared memory that its clients map read-only
(shm/arena.py). A Lookup to it also says where its pages lie there; those refs are remembered
for the get that usually follows, which then reads the pages in place with no Get. A Lookup of
keys that all lie intact where the arena's published index says is answered here, without an RPC
(and told to the server later, touch batching: remote_touch.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiered_cache.client.store_client import StoreClient
from tiered_cache.shm.arena_map import ArenaMap, ArenaRef, ArenaViews, LookupRefs
from tiered_cache.tiers.remote_servers import Ring, Server, StoreServers
from tiered_cache.tiers.remote_touch import Toucher
from tiered_cache.v1 import cache_pb2 as pb


class LentPages(ArenaViews):
    """A lease that also tells, page by page, whether a lent page is still intact: `get_into`
    checks each page right after copying it, so a long get (the arena comes round many times
    over a few GiB) loses only pages it really read too late."""

    def __init__(self) -> None:
        super().__init__()
        self._where: dict[bytes, tuple[ArenaMap, int, int]] = {}

    def add(self, key: bytes, reader: ArenaMap, position: int, length: int) -> None:
        super().add(key, reader, position, length)
        self._where[key] = (reader, position, length)

    def intact(self, key: bytes) -> bool:
        reader, position, length = self._where[key]
        return reader.intact(position, length)


class ArenaReads:
    """Lookups (answered from an arena's index where they can be), the refs they leave, and
    pages read where those refs say. `pages_from_lookup` counts pages read that way (no Get)."""

    def __init__(self, servers: StoreServers) -> None:
        self._servers = servers
        self.refs = LookupRefs()  # same-host arena refs from Lookups, for the gets after
        self.toucher = Toucher(servers)
        self.pages_from_lookup = 0

    def lookup(self, server: Server, keys: list[bytes]) -> Any:
        """The server's Lookup reply (None when it failed). A server on this host also says where
        the pages in its arena lie: remembered for the get that usually follows, which then
        reads them in place with no Get. When every key lies intact where the arena's published
        index says, that answers without an RPC (a server whose breaker is not closed is asked,
        so its health is still probed by real calls)."""
        arena = server.client.arena_map
        reply = None
        if arena is not None and server.closed and not self._servers.closed and keys:
            reply = lookup_in_arena(server.client, keys, arena)
            if reply is not None:
                self.toucher.touch(server, keys, arena)
        if reply is None:
            reply = self._servers.call(server, lambda client: client.lookup(keys, arena=arena), None)
        if reply is not None and arena is not None and reply.shm_lengths:
            self.refs.remember(arena, keys, reply.shm_positions, reply.shm_lengths)
        return reply

    def take_refs(self, keys: Sequence[bytes]) -> dict[bytes, ArenaRef]:
        """Where `keys` lie in same-host servers' arenas: refs a recent Lookup left (each taken
        once), and for the others one Lookup per same-host server now. One unary call answers a
        whole prefix, where a Get would stream a message per page; pages it does not place (held
        below RAM, or not at all) are left to the Get."""
        refs = self.refs.take(keys)
        ring = self._servers.ring
        missing = [key for key in keys if key not in refs]
        if missing:
            groups = self.same_host_groups(ring, missing)
            if groups:
                self._servers.each_server(groups, lambda i, p: self.lookup(ring.servers[i], [missing[j] for j in p]))
                refs.update(self.refs.take(missing))
        return refs

    def same_host_groups(self, ring: Ring, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """`StoreServers.by_server`'s groups of `keys`, only those of servers whose arena is mapped here."""
        return {i: p for i, p in StoreServers.by_server(ring, keys).items()
                if ring.servers[i].client.arena_map is not None}

    @property
    def same_host(self) -> bool:
        """Every server runs on this host and its arena is mapped here."""
        servers = self._servers.ring.servers
        return bool(servers) and all(server.client.arena_map is not None for server in servers)

    def pages(self, keys: Sequence[bytes], fingerprint: bytes, budget_s: float | None) -> list[ArenaRef | None]:
        """Where each key's page lies in a same-host server's arena, or None: refs a Lookup left,
        a Lookup now, and for the rest a Get that first loads them into the arena and answers
        with refs (`RemoteTier.arena_pages`)."""
        refs = self.take_refs(keys)
        self.pages_from_lookup += len(refs)  # located with no Get: the caller reads them in place
        missing = [key for key in dict.fromkeys(keys) if key not in refs]
        servers = self._servers
        ring = servers.ring
        groups = self.same_host_groups(ring, missing)
        if groups and not servers.closed:
            views = ArenaViews()

            def get_refs(index: int, positions: list[int]) -> None:
                def stream(client: StoreClient) -> None:
                    result = client.get_whole([missing[i] for i in positions], fingerprint, budget_s=budget_s,
                                              lease=views)
                    if result.error is not None:
                        raise result.error
                servers.call(ring.servers[index], stream, None)

            servers.each_server(groups, get_refs)
            for key, arena, position, length in views.pages():
                refs.setdefault(key, (arena, position, length))
        return [refs.get(key) for key in keys]

    def close(self) -> None:
        self.refs.clear()
        self.toucher.close()


def lookup_in_arena(client: StoreClient, keys: list[bytes], arena: ArenaMap) -> pb.LookupResponse | None:
    """A Lookup answered here, without an RPC, when every key lies intact where the arena's
    published index says (`ArenaMap.find`) and the server still holds the arena: all held, with
    their refs (not leased). None otherwise: ask the server (`StoreClient.lookup`)."""
    found = arena.find(keys) if arena.server_alive() else None  # a dead server's pages: ask (and fail)
    if found is None:
        return None
    client.arena_lookups += 1
    return pb.LookupResponse(leading=len(keys), tiers=[pb.TIER_RAM] * len(keys),
                             shm_positions=[p for p, _ in found], shm_lengths=[n for _, n in found])
