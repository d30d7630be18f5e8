"""Remote tier: page blobs in one or more store servers, reached over gRPC.

Keys are spread over the servers by rendezvous (highest random weight) hashing with SHA-256, so
every instance sends a key to the same server and adding a server moves only ~1/n of the keys.
Each server has its own circuit breaker (breaker.py): a server that fails (down, stalled, killed
mid-stream) is skipped while its breaker is open and its keys read as misses; one probe call
then tells whether it is back. Nothing raises into the request path. Streams
fail only when nothing moves for `timeout_s` (a progress deadline: a long prefix arrives as long
as it keeps arriving), or past `budget_s` when set. The servers owning keys of one call are asked
in parallel and their pages merged in order. Every blob received is verified before it is
returned.

The set of servers can change while the tier is in use (`set_addresses`: a cluster's shard
directory moved): each call works on the ring it started with, so a shard that leaves turns its
keys into misses, never into errors.
"""

from __future__ import annotations

import enum
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from tiered_cache.client.store_client import StoreClient
from tiered_cache.shm.arena_map import ArenaMap, ArenaRef, ArenaViews, LookupRefs
from tiered_cache.tiers.base import TierStats, leading_run
from tiered_cache.tiers.breaker import BreakerPolicy, BreakerState, CircuitBreaker, breaker_states
from tiered_cache.wire.codec import BlobError, PageDest, check_fingerprint, decode_into, verify_blob
from tiered_cache.wire.framing import ReceivedBlob

if TYPE_CHECKING:
    from tiered_cache.model.spec import KVSpec

T = TypeVar("T")
_MAX_FANOUT = 16  # threads asking servers in parallel (created only as calls need them)
_CHECKERS = 2  # threads checking and copying received pages (checksums release the GIL)
TOUCH_DELAY_S = 0.2  # pages read through an arena's index are told to its server this much later
MAX_TOUCH_KEYS = 1 << 16  # keys waiting to be told to one server


def owner(key: bytes, addresses: Sequence[str]) -> int:
    """Index of the server that owns `key`: the highest SHA-256(address || key)."""
    return max(range(len(addresses)),
               key=lambda i: hashlib.sha256(addresses[i].encode() + key).digest()[:8])


def owner_address(key: bytes, addresses: Sequence[str]) -> str | None:
    """The address that owns `key` among `addresses` (None when there is none)."""
    return addresses[owner(key, addresses)] if addresses else None


class _Server:
    def __init__(self, client: StoreClient, policy: BreakerPolicy, address: str = "") -> None:
        self.client = client
        self.breaker = CircuitBreaker(policy, name=f"store server {address}" if address else "")

    @property
    def available(self) -> bool:
        return self.breaker.available

    @property
    def closed(self) -> bool:
        """Its breaker is closed: the last calls to it went through."""
        return self.breaker.state is BreakerState.CLOSED


@dataclass(frozen=True)
class _Ring:
    """The servers at one moment: replaced whole, never changed in place."""

    addresses: tuple[str, ...]
    servers: tuple[_Server, ...]


class _Landed(enum.Enum):
    """What became of one page `get_into` received."""

    ARRIVED = "arrived"
    LOST = "lost"  # a page lent from an arena the server wrote over while it was read: ask again
    CORRUPT = "corrupt"


class _LentPages(ArenaViews):
    """A lease that also tells, page by page, whether a lent page is still intact: `get_into`
    checks each page right after copying it, so a long fetch (the arena comes round many times
    over a few GiB) loses only pages it really read too late."""

    def __init__(self) -> None:
        super().__init__()
        self._where: dict[bytes, tuple[ArenaMap, int, int]] = {}

    def add(self, key: bytes, reader: ArenaMap, position: int, length: int) -> None:
        super().add(key, reader, position, length)
        self._where[key] = (reader, position, length)

    def lent(self, key: bytes) -> bool:
        return key in self._where

    def intact(self, key: bytes) -> bool:
        reader, position, length = self._where[key]
        return reader.intact(position, length)


class RemoteTier:
    name = "remote"
    thread_safe = True  # gRPC channels serve every thread; each call keeps its own state
    lends_views = True  # `get(keys, lease=)`: same-host pages as views into the server's arena

    def __init__(self, addresses: Sequence[str], token: str | None = None, tls_ca: str | None = None,
                 timeout_s: float = 5.0, fingerprint: bytes = b"", breaker: BreakerPolicy | None = None,
                 budget_s: float | None = None, allow_empty: bool = False, shm: bool = True) -> None:
        """`allow_empty`: start with no server (every call a miss) until `set_addresses` names some,
        as a cluster worker does before its shard directory answers. `shm`: read a same-host
        server's pages in place in its arena (off: every page comes over gRPC as bytes)."""
        if not addresses and not allow_empty:
            raise ValueError("the remote tier needs at least one store server address (HOST:PORT)")
        self.budget_s = budget_s  # overall bound of one get or put stream; None: progress only
        self.fingerprint = fingerprint  # when set, servers skip and refuse blobs of other models
        self._client_args = (token, tls_ca, timeout_s)
        self._shm = shm
        self._policy = breaker or BreakerPolicy()
        self._ring_lock = threading.Lock()
        self._ring = _Ring((), ())
        self._stats = TierStats(self.name)
        # Checksums release the GIL (crc32c): two threads check a 35 MB prefix in half the time.
        self._checker = ThreadPoolExecutor(max_workers=_CHECKERS, thread_name_prefix="remote-tier-crc")
        for _ in range(_CHECKERS):  # started now, not by the first fetch
            self._checker.submit(time.sleep, 0.01)
        self._lookup_refs = LookupRefs()  # same-host arena refs from Lookups, for the fetches after
        self.pages_from_lookup = 0  # pages read where a Lookup said they lay (no Get)
        # Its thread is started now: a thread started by the first touch would cost that request
        # a millisecond or more.
        self._toucher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remote-tier-touch")
        self._toucher.submit(lambda: None)
        self._touch_lock = threading.Lock()
        self._touching: dict[_Server, dict[bytes, None]] = {}  # keys read, to tell each server
        self.touches_dropped = 0
        # The caller's thread asks one server itself; these threads ask the others.
        self._fanout = ThreadPoolExecutor(max_workers=_MAX_FANOUT, thread_name_prefix="remote-tier")
        self._closed = False
        self.set_addresses(addresses)

    @property
    def addresses(self) -> list[str]:
        return list(self._ring.addresses)

    @property
    def servers(self) -> list[_Server]:
        return list(self._ring.servers)

    def set_addresses(self, addresses: Sequence[str]) -> bool:
        """Make `addresses` the ring (order does not matter; duplicates count once). Servers that
        stay keep their channel and breaker; channels of servers that left are closed (a call
        still streaming from one ends as a miss). Returns whether the ring changed."""
        wanted = tuple(sorted(set(addresses)))
        with self._ring_lock:
            old = self._ring
            if wanted == old.addresses or self._closed:
                return False
            kept = dict(zip(old.addresses, old.servers, strict=True))
            token, tls_ca, timeout_s = self._client_args
            servers = tuple(kept.pop(a, None) or _Server(StoreClient(a, token, tls_ca, timeout_s, shm=self._shm),
                                                         self._policy, a)
                            for a in wanted)
            self._ring = _Ring(wanted, servers)
        for server in kept.values():
            server.client.close()
        return True

    # --- plumbing ------------------------------------------------------------------------------
    @staticmethod
    def _by_server(ring: _Ring, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """Positions of `keys` grouped by owning server (one server: no hashing; none: no groups)."""
        if len(ring.servers) <= 1:
            return {0: list(range(len(keys)))} if ring.servers and keys else {}
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(owner(key, ring.addresses), []).append(i)
        return groups

    def _call(self, server: _Server, fn: Callable[[StoreClient], T], default: T) -> T:
        if self._closed or not server.breaker.allow():
            return default
        try:
            result = fn(server.client)
        except grpc.RpcError:
            self._stats.errors += 1
            if server.breaker.failed():
                self._stats.breaker_trips += 1
            return default
        server.breaker.succeeded()
        return result

    def _each_server(self, groups: dict[int, list[int]], fn: Callable[[int, list[int]], T]) -> dict[int, T]:
        """`fn(server index, positions)` for every group, in parallel across servers."""
        items = list(groups.items())
        if len(items) <= 1:
            return {index: fn(index, positions) for index, positions in items}
        futures = {index: self._fanout.submit(fn, index, positions) for index, positions in items[1:]}
        results = {items[0][0]: fn(*items[0])}
        results.update({index: future.result() for index, future in futures.items()})
        return results

    def warm(self) -> None:
        """Open every server's channels now (connection, HTTP/2 handshake, the aio channel of bulk
        Gets) with an empty Lookup and Get, so the first request does not pay for them. A server
        that does not answer opens its breaker, as on any call."""
        ring = self._ring

        def connect(client: StoreClient) -> None:
            client.lookup([])
            result = client.get_all([], self.fingerprint)
            if result.error is not None:
                raise result.error

        for server in ring.servers:
            self._call(server, connect, None)

    # --- interface -----------------------------------------------------------------------------
    def _lookup(self, server: _Server, keys: list[bytes]) -> Any:
        """The server's Lookup reply (None when it failed). A server on this host also says where
        the pages in its arena lie: remembered for the fetch that usually follows, which then
        reads them in place with no Get. When every key lies intact where the arena's published
        index says, that answers without an RPC (a server whose breaker is not closed is asked,
        so its health is still probed by real calls)."""
        arena = server.client.arena_map
        reply = None
        if arena is not None and server.closed and not self._closed and keys:
            reply = server.client.lookup_in_arena(keys, arena)
            if reply is not None:
                self._touch(server, keys, arena)
        if reply is None:
            reply = self._call(server, lambda client: client.lookup(keys, arena=arena), None)
        if reply is not None and arena is not None and reply.shm_lengths:
            self._lookup_refs.remember(arena, keys, reply.shm_positions, reply.shm_lengths)
        return reply

    def _touch(self, server: _Server, keys: list[bytes], arena: ArenaMap) -> None:
        """Tell the server, in the background, that these pages are being read (a Lookup: it
        marks them read and leases them), as a Lookup it answered would have: its eviction gives
        pages that are read a second chance. Keys are gathered for `TOUCH_DELAY_S` and sent in one
        Lookup per server, off the moments a request copies pages; past `MAX_TOUCH_KEYS` waiting,
        they are dropped and counted (`touches_dropped`): they only inform eviction."""
        with self._touch_lock:
            waiting = self._touching.get(server)
            first = waiting is None
            if first:
                waiting = self._touching[server] = {}
            room = MAX_TOUCH_KEYS - len(waiting)
            self.touches_dropped += max(0, len(keys) - room)
            waiting.update(dict.fromkeys(keys[:max(0, room)]))
        if not first:
            return

        def touch() -> None:
            time.sleep(TOUCH_DELAY_S)
            with self._touch_lock:
                sent = list(self._touching.pop(server, {}))
            if sent and not self._closed:
                self._call(server, lambda client: client.lookup(sent, arena=arena), None)

        try:
            self._toucher.submit(touch)
        except RuntimeError:  # closed meanwhile
            with self._touch_lock:
                self._touching.pop(server, None)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        out = [False] * len(keys)
        ring = self._ring

        def ask(index: int, positions: list[int]) -> Any:
            return self._lookup(ring.servers[index], [keys[i] for i in positions])

        groups = self._by_server(ring, keys)
        for index, reply in self._each_server(groups, ask).items():
            if reply is not None:
                for i, tier in zip(groups[index], reply.tiers, strict=False):
                    out[i] = tier != 0
        return out

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        ring = self._ring
        if len(ring.servers) == 1:  # the server computes the leading run itself
            reply = self._lookup(ring.servers[0], list(keys))
            return reply.leading if reply is not None else 0
        return leading_run(self.contains(keys))

    def _from_lookup_refs(self, keys: Sequence[bytes], lease: ArenaViews | None
                          ) -> list[tuple[bytes, Future[bytes | None]]]:
        """Pages a recent Lookup found in a same-host server's arena, read there without a Get
        (lent as views with `lease`, else copied out) and checked on the checker threads. A ref
        the arena has written over since is skipped: the caller Gets that page."""
        checks: list[tuple[bytes, Future[bytes | None]]] = []
        if self._closed:
            return checks
        for key, (reader, position, length) in self._take_refs(keys).items():
            try:
                data = reader.view(position, length) if lease is not None else reader.read(position, length)
            except ValueError:  # that map was closed meanwhile (the client closed)
                data = None
            if data is None:
                continue
            if lease is not None:
                lease.add(key, reader, position, length)
            checks.append((key, self._checker.submit(self._verified, key, data, lease)))
        self.pages_from_lookup += len(checks)
        return checks

    def _take_refs(self, keys: Sequence[bytes]) -> dict[bytes, ArenaRef]:
        """Where `keys` lie in same-host servers' arenas: refs a recent Lookup left (each taken
        once), and for the others one Lookup per same-host server now. One unary call answers a
        whole prefix, where a Get would stream a message per page; pages it does not place (held
        below RAM, or not at all) are left to the Get."""
        refs = self._lookup_refs.take(keys)
        ring = self._ring
        missing = [key for key in keys if key not in refs]
        if missing:
            groups = self._same_host_groups(ring, missing)
            if groups:
                self._each_server(groups, lambda i, p: self._lookup(ring.servers[i], [missing[j] for j in p]))
                refs.update(self._lookup_refs.take(missing))
        return refs

    def _same_host_groups(self, ring: _Ring, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """`_by_server`'s groups of `keys`, only those of servers whose arena is mapped here."""
        return {i: p for i, p in self._by_server(ring, keys).items() if ring.servers[i].client.arena_map is not None}

    @property
    def same_host(self) -> bool:
        """Every server runs on this host and its arena is mapped here (after a first bulk Get or
        `warm`): pages can be read where they lie (`arena_pages`)."""
        servers = self._ring.servers
        return bool(servers) and all(server.client.arena_map is not None for server in servers)

    def arena_pages(self, keys: Sequence[bytes]) -> list[ArenaRef | None]:
        """Where each key's page lies in a same-host server's arena, or None: refs a Lookup left,
        a Lookup now, and for the rest a Get that first brings them into the arena (from the
        server's disk or Redis) and answers with refs. Nothing is copied or verified here: the
        caller copies each page from where it lies, checks it, and asks `ArenaMap.intact` after."""
        refs = self._take_refs(keys)
        missing = [key for key in dict.fromkeys(keys) if key not in refs]
        ring = self._ring
        groups = self._same_host_groups(ring, missing)
        if groups and not self._closed:
            views = ArenaViews()

            def bring(index: int, positions: list[int]) -> None:
                def stream(client: StoreClient) -> None:
                    result = client.get_all([missing[i] for i in positions], self.fingerprint,
                                            budget_s=self.budget_s, lease=views)
                    if result.error is not None:
                        raise result.error
                self._call(ring.servers[index], stream, None)

            self._each_server(groups, bring)
            for key, arena, position, length in views.pages():
                refs.setdefault(key, (arena, position, length))
        return [refs.get(key) for key in keys]

    def record_arena_reads(self, arrived: int, missed: int, nbytes: int) -> None:
        """Count pages a caller read from arenas itself (`arena_pages`)."""
        self._stats.hits += arrived
        self._stats.misses += missed
        self._stats.bytes_out += nbytes

    def get(self, keys: Sequence[bytes], lease: ArenaViews | None = None) -> list[bytes | None]:
        """Each key's verified blob or None. A key asked twice is answered at every position.
        With `lease`, a page from a server on this host may be a view into its arena, good only
        until `lease.lost()` names it (`ArenaViews`): copy it before asking."""
        out: list[bytes | None] = [None] * len(keys)
        positions_of: dict[bytes, list[int]] = {}
        for i, key in enumerate(keys):
            positions_of.setdefault(key, []).append(i)
        ready = self._from_lookup_refs(list(positions_of), lease)
        have = {key for key, _ in ready}
        unique = [key for key in positions_of if key not in have]
        ring = self._ring

        def fetch(index: int, positions: list[int]) -> list[tuple[bytes, Future[bytes | None]]]:
            asked = [unique[i] for i in positions]
            checks: list[tuple[bytes, Future[bytes | None]]] = []

            pending = set(asked)

            def check(item: ReceivedBlob) -> None:
                # Checksums run on another thread (they release the GIL) while the stream flows.
                if item.key in pending:
                    pending.discard(item.key)
                    checks.append((item.key, self._checker.submit(self._verified, item.key, item.blob, lease)))

            def stream(client: StoreClient) -> None:
                # Blobs received before a stream breaks stay usable: each is verified on its own.
                result = client.get_all(asked, self.fingerprint, budget_s=self.budget_s, on_blob=check, lease=lease)
                if result.error is not None:
                    raise result.error

            self._call(ring.servers[index], stream, None)
            return checks

        streamed = self._each_server(self._by_server(ring, unique), fetch).values() if unique else []
        for checks in [ready, *streamed]:
            for key, check in checks:
                blob = check.result()
                for i in positions_of[key]:
                    out[i] = blob
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
        lease = _LentPages()
        sizes: dict[bytes, int] = {}  # each page's blob, as received

        def land(key: bytes, data: Any, lent: bool) -> _Landed:
            """Verify `data` where it lies (an arena view when `lent`: no copy) and decode it into
            the key's destinations; a lent page is checked intact after the copy (shm/arena.py)."""
            first, *others = positions_of[key]
            sizes[key] = len(data)
            try:
                decode_into(data, spec, key, dests[first])
                for other in others:  # a key asked twice: every position gets it
                    decode_into(data, spec, key, dests[other], check_crc=False)
            except BlobError:
                return _Landed.LOST if lent and not lease.intact(key) else _Landed.CORRUPT
            if lent and not lease.intact(key):  # after every copy: the bytes copied are the bytes checked
                return _Landed.LOST
            return _Landed.ARRIVED

        submitted: list[Future[Any]] = []  # every page (or share of pages) handed to a checker thread
        try:
            return self._get_into(positions_of, land, lease, submitted, sizes, len(keys))
        finally:  # all landed (or failed) before the caller may free or reuse the destinations,
            wait(submitted)  # also when a stream raised midway

    def _get_into(self, positions_of: dict[bytes, list[int]], land: Callable[[bytes, Any, bool], _Landed],
                  lease: _LentPages, submitted: list[Future[Any]], sizes: dict[bytes, int],
                  num_keys: int) -> list[int]:
        views: list[tuple[bytes, memoryview]] = []
        if not self._closed:
            for key, (reader, position, length) in self._take_refs(list(positions_of)).items():
                try:
                    view = reader.view(position, length)
                except ValueError:  # that map was closed meanwhile (the client closed)
                    view = None
                if view is not None:
                    lease.add(key, reader, position, length)
                    views.append((key, view))
            self.pages_from_lookup += len(views)

        def land_all(share: list[tuple[bytes, memoryview]]) -> list[tuple[bytes, _Landed]]:
            return [(key, land(key, view, True)) for key, view in share]

        # One share per checker thread (every n-th page), not a task per page: on a memory-bound
        # copy the per-task hand-offs cost more than they spread.
        shares = [self._checker.submit(land_all, views[i::_CHECKERS]) for i in range(min(_CHECKERS, len(views)))]
        submitted.extend(shares)
        have = {key for key, _ in views}
        outcomes = self._stream_into([k for k in positions_of if k not in have], land, lease, submitted)
        outcomes.update({key: what for share in shares for key, what in share.result()})
        lost = [key for key, what in outcomes.items() if what is _Landed.LOST]
        if lost:  # as bytes this time: nothing lent, so nothing to lose
            outcomes.update(self._stream_into(lost, land, None, submitted))
        arrived = [0] * num_keys
        for key, what in outcomes.items():
            if what is _Landed.ARRIVED:
                for i in positions_of[key]:
                    arrived[i] = sizes[key]
        self._stats.hits += sum(1 for n in arrived if n)
        self._stats.misses += sum(1 for n in arrived if not n)
        self._stats.bytes_out += sum(arrived)
        self._stats.corrupt += sum(what is _Landed.CORRUPT for what in outcomes.values())
        return arrived

    def _stream_into(self, keys: list[bytes], land: Callable[[bytes, Any, bool], _Landed],
                     lease: _LentPages | None, submitted: list[Future[Any]]) -> dict[bytes, _Landed]:
        """Get `keys` (distinct) from the servers owning them, in parallel, each page handed to
        `land` on the checker threads as it arrives (with whether it is lent from an arena, through
        `lease`); what became of each page received."""
        if not keys:
            return {}
        ring = self._ring

        def fetch(index: int, positions: list[int]) -> list[tuple[bytes, Future[_Landed]]]:
            asked = [keys[i] for i in positions]
            pending = set(asked)
            checks: list[tuple[bytes, Future[_Landed]]] = []

            def arrived(item: ReceivedBlob) -> None:  # on the stream's event loop: hand it over
                if item.key in pending:
                    pending.discard(item.key)
                    lent = lease is not None and lease.lent(item.key)  # added before this call when lent
                    checks.append((item.key, self._checker.submit(land, item.key, item.blob, lent)))
                    submitted.append(checks[-1][1])

            def stream(client: StoreClient) -> None:
                # Pages received before a stream breaks stay usable: each is checked on its own.
                result = client.get_all(asked, self.fingerprint, budget_s=self.budget_s, on_blob=arrived,
                                        lease=lease)
                if result.error is not None:
                    raise result.error

            self._call(ring.servers[index], stream, None)
            return checks

        streamed = self._each_server(self._by_server(ring, keys), fetch).values()
        return {key: check.result() for checks in streamed for key, check in checks}

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        ring = self._ring
        def send(index: int, positions: list[int]) -> tuple[int, int, int]:
            """(pages the server holds now, bytes sent, pages refused) for one server's share."""
            batch = [items[i] for i in positions]
            reply = self._call(ring.servers[index],
                               lambda c: c.put(batch, self.fingerprint, budget_s=self.budget_s), None)
            if reply is None:
                return 0, 0, 0
            return reply.stored + reply.already_held, sum(len(b) for _, b in batch), len(reply.refused)

        results = self._each_server(self._by_server(ring, [k for k, _ in items]), send).values()
        self._stats.bytes_in += sum(r[1] for r in results)  # counted here: one thread
        self._stats.errors += sum(r[2] for r in results)
        return sum(r[0] for r in results)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Stores are shared and content-addressed: a client never deletes (the server evicts)."""

    def stats(self) -> TierStats:
        ring = self._ring
        states = breaker_states({a: s.breaker for a, s in zip(ring.addresses, ring.servers, strict=True)})
        self._stats.open_breakers, self._stats.breakers = states
        return self._stats

    def close(self) -> None:
        """Close the channels; afterwards every call is a miss (never an error)."""
        with self._ring_lock:
            self._closed = True
            ring, self._ring = self._ring, _Ring((), ())
        self._lookup_refs.clear()
        for server in ring.servers:
            server.client.close()
        self._checker.shutdown(wait=False)
        self._fanout.shutdown(wait=False)
        self._toucher.shutdown(wait=False)

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
