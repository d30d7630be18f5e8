"""Remote tier: page blobs in one or more store servers, reached over gRPC (and the bulk Get).

Keys are spread over the servers by rendezvous hashing, each server behind its own circuit
breaker (`StoreServers`, remote_servers.py): a server that fails is skipped while its breaker is
open and its keys read as misses. Nothing raises into the request path. Streams
fail only when nothing moves for `timeout_s` (a progress deadline: a long prefix arrives as long
as it keeps arriving), or past `budget_s` when set. The servers owning keys of one call are asked
in parallel and their pages merged in order. Every blob received is verified before it is
returned.

The set of servers can change while the tier is in use (`set_addresses`: a cluster's shard
directory moved): each call works on the ring it started with, so a shard that leaves turns its
keys into misses, never into errors. Servers on this host are read in place in their arenas
(`ArenaReads`, remote_arena.py).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from tiered_cache.client.reads import Transport, read_pages
from tiered_cache.client.store_client import StoreClient
from tiered_cache.shm.arena_map import ArenaRef, ArenaViews
from tiered_cache.tiers.base import Tier, TierStats, leading_run
from tiered_cache.tiers.breaker import BreakerPolicy, breaker_states
from tiered_cache.tiers.remote_arena import ArenaReads, LentPages
from tiered_cache.tiers.remote_servers import Server, StoreServers
from tiered_cache.wire.checksum import checker_threads
from tiered_cache.wire.codec import BlobError, PageDest, check_fingerprint, decode_into, verify_blob

if TYPE_CHECKING:
    from tiered_cache.model.spec import KVSpec

_DONE: Future[Any] = Future()
_DONE.set_result(None)


class _Placed(enum.Enum):
    """What became of one page `get_into` received: placed (verified and written into its
    destinations), lost or corrupt."""

    PLACED = "placed"
    LOST = "lost"  # a page lent from an arena the server wrote over while it was read: ask again
    CORRUPT = "corrupt"


class RemoteTier:
    name = Tier.REMOTE.value
    thread_safe = True  # gRPC channels serve every thread; each call keeps its own state
    lends_views = True  # `get(keys, lease=)`: same-host pages as views into the server's arena

    def __init__(self, addresses: Sequence[str], token: str | None = None, tls_ca: str | None = None,
                 timeout_s: float = 5.0, fingerprint: bytes = b"", breaker: BreakerPolicy | None = None,
                 budget_s: float | None = None, allow_empty: bool = False, shm: bool = True,
                 namespace: str | None = None) -> None:
        """`allow_empty`: start with no server (every call a miss) until `set_addresses` names some,
        as a cluster worker does before its shard directory answers. `shm`: read a same-host
        server's pages in place in its arena (off: every page comes over gRPC as bytes).
        `namespace`: the servers' namespace to read and write (None: the token's first)."""
        if not addresses and not allow_empty:
            raise ValueError("the remote tier needs at least one store server address (HOST:PORT)")
        self.budget_s = budget_s  # overall bound of one get or put stream; None: progress only
        self.fingerprint = fingerprint  # when set, servers skip and refuse blobs of other models
        self._stats = TierStats(self.name)
        self._refused = 0  # pages servers refused to store (counted as errors)
        self.bulk_gets = 0  # servers' shares of a read (`get`, `get_into`) served by a bulk Get (client/reads.py)
        # Threads checking and copying received pages: checksums and copies release the GIL, so n
        # threads place a prefix in about 1/n of the time, up to the memory's bandwidth.
        self.checkers = checker_threads()
        self._checker = ThreadPoolExecutor(max_workers=self.checkers, thread_name_prefix="remote-tier-crc")
        for _ in range(self.checkers):  # started now, not by the first get
            self._checker.submit(time.sleep, 0.01)
        self.stores = StoreServers(token, tls_ca, timeout_s, shm, breaker or BreakerPolicy(), namespace)
        self.arena_reads = ArenaReads(self.stores)
        self.stores.set_addresses(addresses)

    @property
    def addresses(self) -> list[str]:
        return list(self.stores.ring.addresses)

    @property
    def servers(self) -> list[Server]:
        return list(self.stores.ring.servers)

    @property
    def pages_from_lookup(self) -> int:
        """Pages read where a Lookup said they lay (no Get)."""
        return self.arena_reads.pages_from_lookup

    @property
    def touches_dropped(self) -> int:
        """Keys read through an arena's index never told to its server (too many waiting)."""
        return self.arena_reads.toucher.dropped

    def set_addresses(self, addresses: Sequence[str]) -> bool:
        """Make `addresses` the ring (`StoreServers.set_addresses`); returns whether it changed."""
        return self.stores.set_addresses(addresses)

    def warm(self) -> None:
        """Open every server's channels now (connection, HTTP/2 handshake, the aio channel of Get,
        the bulk Get's connection) with an empty Lookup and Get, so the first request does not
        pay for them. A server that does not answer opens its breaker, as on any call."""
        for server in self.stores.ring.servers:
            self.stores.call(server, lambda client: _connect(client, self.fingerprint), None)

    # --- interface -----------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        out = [False] * len(keys)
        ring = self.stores.ring

        def ask(index: int, positions: list[int]) -> Any:
            return self.arena_reads.lookup(ring.servers[index], [keys[i] for i in positions])

        groups = StoreServers.by_server(ring, keys)
        for index, reply in self.stores.each_server(groups, ask).items():
            if reply is not None:
                for i, tier in zip(groups[index], reply.tiers, strict=False):
                    out[i] = tier != 0
        return out

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        ring = self.stores.ring
        if len(ring.servers) == 1:  # the server computes the leading run itself
            reply = self.arena_reads.lookup(ring.servers[0], list(keys))
            return reply.leading if reply is not None else 0
        return leading_run(self.contains(keys))

    @property
    def same_host(self) -> bool:
        """Every server runs on this host and its arena is mapped here (after a first bulk Get or
        `warm`): pages can be read where they lie (`arena_pages`)."""
        return self.arena_reads.same_host

    def arena_pages(self, keys: Sequence[bytes]) -> list[ArenaRef | None]:
        """Where each key's page lies in a same-host server's arena, or None: refs a Lookup left,
        a Lookup now, and for the rest a Get that first loads them into the arena (from the
        server's disk or Redis) and answers with refs. Nothing is copied or verified here: the
        caller copies each page from where it lies, checks it, and asks `ArenaMap.intact` after."""
        return self.arena_reads.pages(keys, self.fingerprint, self.budget_s)

    def record_arena_reads(self, arrived: int, missed: int, nbytes: int) -> None:
        """Count pages a caller read from arenas itself (`arena_pages`)."""
        self._stats.hits += arrived
        self._stats.misses += missed
        self._stats.bytes_out += nbytes

    def get(self, keys: Sequence[bytes], lease: ArenaViews | None = None) -> list[bytes | None]:
        """Each key's verified blob or None. A key asked twice is answered at every position.
        With `lease`, a page from a server on this host may be a view into its arena, good only
        until `lease.lost()` names it (`ArenaViews`): copy it before asking. The same read as
        `get_into`, with destinations that keep each blob."""

        def keep(key: bytes, data: Any, lent: bool) -> bytes | None:
            # A lent view stays a view; a bulk Get's page lies in a reused buffer: copied out.
            return self._verified(key, data if lent or isinstance(data, bytes) else bytes(data), lease)

        got = self._read(list(dict.fromkeys(keys)), keep, lease)
        out = [got.get(key) for key in keys]
        self._stats.record_reads(out)
        return out

    def get_into(self, keys: Sequence[bytes], dests: Sequence[PageDest], spec: KVSpec) -> list[int]:
        """Write each key's page of `spec`, verified, into `dests[i]` (codec.py's destinations);
        returns the size of each blob whose page arrived, 0 for a miss. Pages of a server on this
        host are lent as views into its arena (those a recent Lookup found there, without a Get at
        all) and each is checked and copied into its destination as it arrives, on the checker
        threads while the stream flows: one copy per page and no fresh memory, where `get` makes
        a blob of each. A page the arena wrote over before it was copied is asked again as
        bytes; a page refused is a miss, counted (a client never deletes from a shared store)."""
        positions_of: dict[bytes, list[int]] = {}
        for i, key in enumerate(keys):
            positions_of.setdefault(key, []).append(i)
        lease = LentPages()
        sizes: dict[bytes, int] = {}  # each page's blob, as received

        def place(key: bytes, data: Any, lent: bool) -> _Placed:
            """Verify `data` where it lies (an arena view when `lent`: no copy) and decode it into
            the key's destinations; a lent page is checked intact after the copy (shm/arena.py)."""
            first, *others = positions_of[key]
            sizes[key] = len(data)
            try:
                decode_into(data, spec, key, dests[first])
                for other in others:  # a key asked twice: every position gets it
                    decode_into(data, spec, key, dests[other], check_crc=False)
            except BlobError:
                return _Placed.LOST if lent and not lease.intact(key) else _Placed.CORRUPT
            if lent and not lease.intact(key):  # after every copy: the bytes copied are the bytes checked
                return _Placed.LOST
            return _Placed.PLACED

        outcomes = self._read(list(positions_of), place, lease)
        lost = [key for key, what in outcomes.items() if what is _Placed.LOST]
        if lost:  # as bytes this time: nothing lent, so nothing to lose
            outcomes.update(self._read(lost, place, None, in_place=False))
        arrived = [0] * len(keys)
        for key, what in outcomes.items():
            if what is _Placed.PLACED:
                for i in positions_of[key]:
                    arrived[i] = sizes[key]
        self._stats.hits += sum(1 for n in arrived if n)
        self._stats.misses += sum(1 for n in arrived if not n)
        self._stats.bytes_out += sum(arrived)
        self._stats.corrupt += sum(what is _Placed.CORRUPT for what in outcomes.values())
        return arrived

    def _read(self, keys: list[bytes], place: Callable[[bytes, Any, bool], Any], lease: ArenaViews | None,
              in_place: bool = True) -> dict[bytes, Any]:
        """The one read path: `keys` (distinct) from the servers owning them, in parallel, each
        server's share by the transport `client/reads.py` picks (pages a Lookup found in a
        same-host arena read there, when `in_place`); every page handed to `place(key, data,
        lent)` on the checker threads as it arrives. Returns what `place` made of each page
        received; every page is placed (or failed) before this returns, also when a stream
        broke midway, so the caller may free or reuse its destinations."""
        if not keys:
            return {}
        ring = self.stores.ring
        refs = self.arena_reads.take_refs(keys) if in_place and not self.stores.closed else {}
        placements = _Placements(place, self._checker, self.checkers)

        def from_server(index: int, positions: list[int]) -> None:
            server = ring.servers[index]
            transport, in_arena = read_pages(
                server.client, [keys[i] for i in positions], self.fingerprint, placements, refs=refs, lease=lease,
                budget_s=self.budget_s, guard=lambda get: self.stores.call(server, get, None))
            self.arena_reads.pages_from_lookup += in_arena
            if transport is Transport.BULK:
                self.bulk_gets += 1

        try:
            self.stores.each_server(StoreServers.by_server(ring, keys), from_server)
        finally:
            placements.wait()
        return placements.outcomes()

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        ring = self.stores.ring
        def send(index: int, positions: list[int]) -> tuple[int, int, int]:
            """(pages the server holds now, bytes sent, pages refused) for one server's share."""
            batch = [items[i] for i in positions]
            reply = self.stores.call(ring.servers[index],
                                     lambda c: c.put(batch, self.fingerprint, budget_s=self.budget_s), None)
            if reply is None:
                return 0, 0, 0
            return reply.stored + reply.already_held, sum(len(b) for _, b in batch), len(reply.refused)

        results = self.stores.each_server(StoreServers.by_server(ring, [k for k, _ in items]), send).values()
        self._stats.bytes_in += sum(r[1] for r in results)  # counted here: one thread
        self._refused += sum(r[2] for r in results)
        return sum(r[0] for r in results)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Stores are shared and content-addressed: a client never deletes (the server evicts)."""

    def stats(self) -> TierStats:
        ring = self.stores.ring
        states = breaker_states({a: s.breaker for a, s in zip(ring.addresses, ring.servers, strict=True)})
        self._stats.open_breakers, self._stats.breakers = states
        self._stats.errors = self.stores.errors + self._refused  # failed calls, and pages refused
        self._stats.breaker_trips = self.stores.breaker_trips
        return self._stats

    def close(self) -> None:
        """Close the channels; afterwards every call is a miss (never an error). Pages read in
        same-host arenas are told to their servers first (`Toucher.close`)."""
        self.arena_reads.close()
        self.stores.close()
        self._checker.shutdown(wait=False)

    def _verified(self, key: bytes, blob: bytes, lease: ArenaViews | None = None) -> bytes | None:
        try:
            header = verify_blob(blob, key)
            if self.fingerprint:  # as the server's filter does for a Get (a page read by ref had none)
                check_fingerprint(header, self.fingerprint)
        except BlobError:
            if lease is None or key not in lease.lost():  # a lent page written over is no fault
                self._stats.corrupt += 1
            return None
        return blob


def _connect(client: StoreClient, fingerprint: bytes) -> None:
    """`RemoteTier.warm` of one server: its channels, its arena map, its bulk Get's connection."""
    client.lookup([])
    result = client.get_whole([], fingerprint)
    if result.error is not None:
        raise result.error
    bulk = client.bulk()
    if bulk is not None:
        bulk.warm()  # refused or unreachable: dropped (gRPC's Get serves), not held against the server


class _Placements:
    """The pages of one read handed to the checker threads, each once (checksums and copies
    release the GIL: n threads place a prefix in about 1/n of the time); what became of each."""

    def __init__(self, place: Callable[[bytes, Any, bool], Any], checker: ThreadPoolExecutor, shares: int) -> None:
        self._place = place
        self._checker = checker
        self._shares = shares
        self._each: dict[bytes, Future[Any]] = {}
        self._batches: list[Future[list[tuple[bytes, Any]]]] = []

    def one(self, key: bytes, data: Any, lent: bool) -> Future[Any]:
        if key in self._each:  # a page sent twice, or not asked for: placed once
            return _DONE
        future = self._each[key] = self._checker.submit(self._place, key, data, lent)
        return future  # a bulk Get waits for it before reading into that buffer again

    def many(self, pages: list[tuple[bytes, Any]], lent: bool) -> None:
        # One share per checker thread (every n-th page), not a task per page: on a memory-bound
        # copy the per-task hand-offs cost more than they spread.
        def place_all(share: list[tuple[bytes, Any]]) -> list[tuple[bytes, Any]]:
            return [(key, self._place(key, data, lent)) for key, data in share]

        k = self._shares
        self._batches += [self._checker.submit(place_all, pages[i::k]) for i in range(min(k, len(pages)))]

    def wait(self) -> None:
        wait([*self._each.values(), *self._batches])

    def outcomes(self) -> dict[bytes, Any]:
        got = {key: future.result() for key, future in self._each.items()}
        for batch in self._batches:
            got.update(batch.result())
        return got
