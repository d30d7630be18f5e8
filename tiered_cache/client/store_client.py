"""`StoreClient`: a thin, typed client of one store server (imports only the stubs and `wire/`).

Calls raise `grpc.RpcError` like any gRPC client; `tiers/remote.py` turns failures into misses.

Deadlines: Lookup and Stats are small and get `timeout_s` as a plain deadline. Get and Put
streams get a *progress* deadline instead: they fail only when no message moves for
`timeout_s` (`StreamStalled`), so a 10 GiB prefix arrives as long as it keeps arriving; an
optional overall `budget_s` bounds the whole call where the caller wants one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc

from tiered_cache.client.bulk_endpoint import BulkEndpoint
from tiered_cache.client.get_streams import GetResult, GetStreams
from tiered_cache.shm.arena_map import ArenaMap, ArenaViews
from tiered_cache.shm.host import host_identity
from tiered_cache.shm.put_ring import PutRing
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.v1 import cache_pb2_grpc
from tiered_cache.wire.auth import check_token
from tiered_cache.wire.deadline import BudgetSpent, ProgressDeadline
from tiered_cache.wire.framing import ReceivedBlob, page_blob_message
from tiered_cache.wire.namespaces import NAMESPACE_METADATA, check_namespace
from tiered_cache.wire.options import DEFAULT_MAX_MESSAGE, channel_options

PUT_RING_BYTES = 64 * 2**20  # a client's ring for same-host Put: Puts of up to half of it each
_MAX_OFFERED_PAGES = 4096  # pages per PutOffered request (about 200 KiB of message)
# Answers meaning this server will not take Puts through our ring (older, or not ours to use).
_NO_SHM_PUT = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class StoreClient:
    def __init__(self, address: str, token: str | None = None, tls_ca: str | None = None,
                 timeout_s: float = 5.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE, shm: bool = True,
                 put_ring_bytes: int = PUT_RING_BYTES, namespace: str | None = None) -> None:
        """`shm`: on the server's host, read pages in place in its arena (shm/arena.py) and send
        Puts through a put ring of this client's own (`put_ring_bytes`, mapped by the server).
        `namespace`: the server's namespace this client reads and writes (its token must allow
        it; None: the token's first, server/tenants.py)."""
        self.address = address
        self.shm = shm
        self.timeout_s = timeout_s
        options = channel_options(max_message_bytes)
        if tls_ca:
            try:
                ca = Path(tls_ca).read_bytes()
            except OSError as exc:
                raise ValueError(f"the TLS CA file {tls_ca} (--tls-ca, remote_tls_ca): {exc.strerror or exc}") from None
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = cache_pb2_grpc.KVCacheStub(self.channel)
        # Put's items are serialized by hand (framing.page_blob_message): one copy of each blob
        # instead of two. Get goes over an aio channel (get_streams.py), its replies parsed by hand too.
        self._put = self.channel.stream_unary("/tiered_cache.v1.KVCache/Put", request_serializer=_put_item,
                                              response_deserializer=pb.PutResponse.FromString)
        token = check_token(token, "the store server token")
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        if namespace is not None:
            self.metadata += ((NAMESPACE_METADATA, check_namespace(namespace, "remote namespace")),)
        self._options, self._tls_ca = options, tls_ca  # for the aio channel of Get
        self._streams: GetStreams | None = None  # the aio channel of Get, opened on first use
        self._attached = False  # whether the first get_whole asked for the server's arena
        self._streams_lock = threading.Lock()
        # Same-host Put: this client's own ring, which the server maps once offered (put()).
        self.put_ring_bytes = put_ring_bytes
        self._put_ring: PutRing | None = None
        self._offered = self._offer_refused = False
        self._offer_lock = threading.Lock()
        self._ring_put_lock = threading.Lock()
        self.shm_put_resent = 0  # pages the server found written over (or unmapped), sent again as bytes
        self.arena_lookups = 0  # Lookups answered from the arena's published index, without an RPC
        # The bulk Get: its port from Attach (`_attach_reply`), asked for on first use.
        metadata = dict(self.metadata)
        self._bulk = BulkEndpoint(address.rsplit(":", 1)[0], metadata.get("authorization", ""),
                                  metadata.get(NAMESPACE_METADATA, ""), timeout_s,
                                  lambda: None if (reply := self._attach_reply()) is None else reply.bulk_port)

    def lookup(self, keys: list[bytes], timeout_s: float | None = None, arena: ArenaMap | None = None
               ) -> pb.LookupResponse:
        """Which keys the server holds. With `arena` (`arena_map`), the reply also says where the
        pages in its arena lie (`shm_positions`, `shm_lengths`), each leased for a short while."""
        request = pb.LookupRequest(keys=keys, shm_segment=arena.id if arena is not None else b"")
        return self.stub.Lookup(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)

    @property
    def arena_map(self) -> ArenaMap | None:
        """The server's arena as mapped here (after a first bulk Get found it on this host), or None."""
        streams = self._streams
        return streams.reader if streams is not None and not streams.stale else None

    def get(self, keys: list[bytes], fingerprint: bytes = b"", timeout_s: float | None = None,
            budget_s: float | None = None) -> Iterator[ReceivedBlob]:
        """The held blobs among `keys`, streamed in order (a missing key is skipped), as bytes.
        Raises `StreamStalled` when no blob arrives for `timeout_s`; `budget_s` bounds the whole
        call. The same Get as `get_whole`, a blob at a time."""
        yield from self._streams_for(attach=False).stream(keys, fingerprint, timeout_s or self.timeout_s, budget_s)

    def get_whole(self, keys: list[bytes], fingerprint: bytes = b"", timeout_s: float | None = None,
                  budget_s: float | None = None, on_blob: Callable[[ReceivedBlob], None] | None = None,
                  lease: ArenaViews | None = None) -> GetResult:
        """Like `get`, but the whole stream at once, read on an aio channel (faster for bulk
        gets: see get_streams.py); the error that ended it, if any, is returned, not raised.
        With `lease`, pages that come as refs into the server's arena are lent as views into it (see
        `ArenaViews`: check `lease.lost()` after copying them)."""
        streams = self._streams_for(attach=True)
        return streams.get_whole(keys, fingerprint, timeout_s or self.timeout_s, budget_s, on_blob, lease)

    def _streams_for(self, attach: bool) -> GetStreams:
        """The aio channel of Get, opened on first use; with `attach`, the server's arena mapped
        on the first call (when `shm`), and again after the server restarted."""
        with self._streams_lock:
            if self._streams is None:
                self._streams = GetStreams(self.address, self._options, self._tls_ca, self.metadata)
            streams = self._streams
            if attach and not self._attached:
                self._attached = True
                if self.shm:
                    streams.reader = self.attach()
            elif attach and streams.stale:  # the server restarted: its arena is another segment
                streams.stale = False
                # Not closed here: a Get on another thread may still be reading it (it unmaps
                # when the last reference goes).
                streams.reader = self.attach()
        return streams

    @property
    def shm_overruns(self) -> int:
        """Pages the server's arena wrote over before this client copied them (asked again as bytes)."""
        return self._streams.overruns if self._streams is not None else 0

    @property
    def uses_shm(self) -> bool:
        return self._streams is not None and self._streams.reader is not None

    def attach(self) -> ArenaMap | None:
        """The server's arena, mapped read-only, when the server keeps one and runs on this host
        as this user; None otherwise (Get then moves bytes, as to any other host)."""
        reply = self._attach_reply()
        if reply is None:
            return None  # down, or a server without Attach: bytes
        if not reply.path or not reply.host or reply.host != host_identity():
            return None
        try:
            return ArenaMap(reply.path, reply.size, reply.segment)
        except (OSError, ValueError):
            return None  # another container, another user, or the pid is not the server's any more

    def _attach_reply(self) -> pb.AttachResponse | None:
        try:
            return self.stub.Attach(pb.AttachRequest(), timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError:
            return None

    def bulk(self) -> BulkEndpoint | None:
        """The server's bulk Get (client/bulk_endpoint.py: pages as bytes over plain TCP, the fast
        path from another host), unless this client reads the server's arena (same host) or uses
        TLS; None then (gRPC's Get)."""
        if self._tls_ca or (self.shm and self._streams_for(attach=True).reader is not None):
            return None
        return self._bulk

    def put(self, items: Iterable[tuple[bytes, bytes]], fingerprint: bytes = b"",
            timeout_s: float | None = None, budget_s: float | None = None) -> pb.PutResponse:
        """Stream pages to the server and return its ack. Raises `StreamStalled` when the server
        takes no page for `timeout_s` (or does not answer that long after the last).

        To a server on this host (same user) the pages go through a ring of this client's own
        that the server maps (`Offer`, shm/offers.py): a `PutOffered` call names where each page
        lies instead of carrying it, at most half the ring per call, so the ring does not come
        round over pages the server has yet to read; any it did come round over are sent again
        as bytes by Put. The ack counts every page either way."""
        ring = self._offered_ring() if self.shm else None
        if ring is None:
            return self._put_bytes(items, fingerprint, timeout_s, budget_s)
        ends = None if budget_s is None else time.monotonic() + budget_s  # `budget_s` bounds the whole put
        reply = pb.PutResponse()
        for chunk in _chunks(items, ring.capacity // 2, _MAX_OFFERED_PAGES):
            # One put through the ring at a time: two threads placing half a ring each would
            # lap each other's pages before the server read them (then sent twice).
            if ends is not None and time.monotonic() >= ends:  # a call past its budget is not made
                raise BudgetSpent(f"Put to {self.address}", budget_s or 0.0)
            with self._ring_put_lock:
                _add_up(reply, self._put_through(ring, chunk, fingerprint, timeout_s, ends))
        return reply

    def _put_through(self, ring: PutRing, items: list[tuple[bytes, bytes]], fingerprint: bytes,
                     timeout_s: float | None, ends: float | None) -> pb.PutResponse:
        """`items` placed in this client's offered ring and stored by one PutOffered call; pages
        too large for the ring, and any the ring came round over first, go by Put as bytes.
        `ends`: the whole put's end (monotonic), or None."""
        pages, rest = [], []
        for key, blob in items:
            try:
                where = ring.place(blob)
            except ValueError:  # the ring was closed meanwhile (close() on another thread): bytes
                where = None
            if where is None:
                rest.append((key, blob))
            else:
                pages.append(pb.OfferedPage(key=key, position=where[0], length=where[1]))
        request = pb.PutOfferedRequest(segment=ring.segment, fingerprint=fingerprint, pages=pages)
        # A unary call (no request-stream thread): the server copies at most half a ring
        # (`_chunks`), well inside the progress timeout, which serves as its deadline.
        deadline = min(t for t in (_left(ends), timeout_s or self.timeout_s) if t)
        try:
            reply = self.stub.PutOffered(request, timeout=deadline, metadata=self.metadata)
        except grpc.RpcError as exc:
            for_good = exc.code() in _NO_SHM_PUT  # a server without PutOffered (or not for us)
            with self._offer_lock:
                if for_good:
                    self._refuse_offer()  # bytes from now on
                else:
                    self._offered = False  # down, or restarted: offered again next time
            if not for_good:
                raise
            return self._put_bytes(items, fingerprint, timeout_s, _left(ends))
        lost = Counter(r.key for r in reply.refused if r.reason == pb.SHM_LOST)
        if lost:
            self.shm_put_resent += sum(lost.values())
            if sum(lost.values()) == len(pages):  # every page lost: the server no longer maps the ring
                with self._offer_lock:
                    self._offered = False  # offered again by the next put (a restarted server)
            kept = [r for r in reply.refused if r.reason != pb.SHM_LOST]
            del reply.refused[:]
            reply.refused.extend(kept)
            for key, blob in items:  # as many of each key as were lost (a key may repeat)
                if lost[key]:
                    lost[key] -= 1
                    rest.append((key, blob))
        if rest:
            _add_up(reply, self._put_bytes(rest, fingerprint, timeout_s, _left(ends)))
        return reply

    def _offered_ring(self) -> PutRing | None:
        """This client's Put ring once the server (on this host) maps it; None where it cannot
        (another host, `--shm off`, another user, an older server): Put then carries bytes."""
        with self._offer_lock:
            if self._offered or self._offer_refused:
                return self._put_ring if self._offered else None
            try:
                if self._put_ring is None:
                    reply = self.stub.Attach(pb.AttachRequest(), timeout=self.timeout_s, metadata=self.metadata)
                    if not reply.host or reply.host != host_identity():  # elsewhere, or shm off
                        self._offer_refused = True
                        return None
                    self._put_ring = PutRing(self.put_ring_bytes)
                ring = self._put_ring
                answer = self.stub.Offer(pb.OfferRequest(path=ring.path, size=ring.size, segment=ring.segment,
                                                         host=host_identity()),
                                         timeout=self.timeout_s, metadata=self.metadata)
            except grpc.RpcError as exc:
                if exc.code() in _NO_SHM_PUT:
                    self._refuse_offer()
                return None  # down: bytes this time, asked again next time
            except (OSError, ValueError):  # no memfd here (limits, memory): bytes from now on
                self._refuse_offer()
                return None
            if not answer.accepted:
                self._refuse_offer()
                return None
            self._offered = True
            return ring

    def _refuse_offer(self) -> None:
        """Bytes from now on (under the offer lock)."""
        self._offer_refused, self._offered = True, False
        if self._put_ring is not None:
            self._put_ring.close()
            self._put_ring = None

    @property
    def uses_shm_put(self) -> bool:
        return self._offered

    def _put_bytes(self, items: Iterable[tuple[bytes, bytes]], fingerprint: bytes, timeout_s: float | None,
                   budget_s: float | None) -> pb.PutResponse:
        """One Put stream carrying the pages' bytes (`PageBlob`s framed by hand); its ack."""
        watch: ProgressDeadline | None = None

        def stream() -> Iterator[bytes]:
            for key, blob in items:
                yield page_blob_message(key, blob, fingerprint)
                if watch is not None:
                    watch.progress()  # the previous page was taken: flow control let it go

        future = self._put.future(stream(), timeout=budget_s, metadata=self.metadata)
        watch = ProgressDeadline(timeout_s or self.timeout_s, f"Put to {self.address}", future.cancel)
        try:
            return future.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            if watch.stalled:
                raise watch.error() from exc
            raise
        finally:
            watch.close()

    def stats(self, timeout_s: float | None = None) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=timeout_s or self.timeout_s, metadata=self.metadata)

    def health(self, timeout_s: float | None = None) -> str:
        """'SERVING', 'NOT_SERVING', ... of the store service (health needs no token)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service="tiered_cache.v1.KVCache"),
                           timeout=timeout_s or self.timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self._bulk.close()
        self.channel.close()
        if self._streams is not None:
            self._streams.close()
        with self._offer_lock:
            if self._put_ring is not None:  # the server's map of it stays valid until it unmaps
                self._put_ring.close()
                self._put_ring = None
            self._offered = False
            self._offer_refused = True

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _left(ends: float | None) -> float | None:
    """Seconds left until `ends` (monotonic), or None for no bound. Never 0, which the deadline
    choices above read as no bound: past the end, a call gets a millisecond and fails with
    DEADLINE_EXCEEDED."""
    return None if ends is None else max(ends - time.monotonic(), 1e-3)


def _put_item(message: bytes) -> bytes:
    return message  # framed by hand (wire/framing.py)


def _chunks(items: Iterable[tuple[bytes, bytes]], max_bytes: int, max_count: int
            ) -> Iterator[list[tuple[bytes, bytes]]]:
    """`items` in runs of at most `max_bytes` and `max_count` (a larger page alone in its run)."""
    chunk: list[tuple[bytes, bytes]] = []
    size = 0
    for key, blob in items:
        if chunk and (size + len(blob) > max_bytes or len(chunk) >= max_count):
            yield chunk
            chunk, size = [], 0
        chunk.append((key, blob))
        size += len(blob)
    if chunk:
        yield chunk


def _add_up(into: pb.PutResponse, reply: pb.PutResponse) -> None:
    """Add a Put's `reply` to the ack of the whole call."""
    into.stored += reply.stored
    into.already_held += reply.already_held
    into.refused.extend(reply.refused)
