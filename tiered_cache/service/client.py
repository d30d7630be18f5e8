"""`StoreClient`: a thin, typed client of one store server (imports only the stubs and codec).

Calls raise `grpc.RpcError` like any gRPC client; `tiers/remote.py` turns failures into misses.

Deadlines: Lookup and Stats are small and get `timeout_s` as a plain deadline. Get and Put
streams get a *progress* deadline instead: they fail only when no message moves for
`timeout_s` (`StreamStalled`), so a 10 GiB prefix arrives as long as it keeps arriving; an
optional overall `budget_s` bounds the whole call where the caller wants one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc

from tiered_cache.service.aio_fetch import AioFetcher, FetchResult
from tiered_cache.service.auth import check_token
from tiered_cache.service.config import ServerConfig
from tiered_cache.service.framing import ReceivedBlob, page_blob_message, parse_page_blob
from tiered_cache.service.shm_ring import ShmLease, ShmReader, host_identity
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.v1 import cache_pb2_grpc

DEFAULT_MAX_MESSAGE = ServerConfig().max_message_bytes  # the server's default page limit + framing


class StreamStalled(grpc.RpcError):
    """No message moved on a stream for the progress deadline; the call was cancelled."""

    def __init__(self, what: str, idle_s: float) -> None:
        super().__init__(f"{what}: nothing moved for {idle_s:g} s (progress deadline)")
        self.idle_s = idle_s

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return str(self)


class ProgressDeadline:
    """Cancels `call` when `progress()` has not been called for `idle_s` (checked by a daemon
    thread a few times per `idle_s`); `close()` when the call is over."""

    def __init__(self, call: Any, idle_s: float, what: str) -> None:
        self.call, self.idle_s, self.what = call, idle_s, what
        self.stalled = False
        self._last = time.monotonic()
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="tiered-cache-progress", daemon=True).start()

    def progress(self) -> None:
        self._last = time.monotonic()

    def close(self) -> None:
        self._done.set()

    def error(self) -> StreamStalled:
        return StreamStalled(self.what, self.idle_s)

    def _watch(self) -> None:
        while not self._done.wait(min(self.idle_s / 4, 1.0)):
            if time.monotonic() - self._last > self.idle_s:
                self.stalled = True
                self.call.cancel()
                return


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options both ends share: messages bounded by one page, a large HTTP/2 window for streams
    (a server stream of 1 MiB messages measured ~1.15 GiB/s with 16 MiB lookahead)."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.http2.lookahead_bytes", 16 * 2**20)]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Client channel options: shared ones, and no transparent retries (the remote tier decides)."""
    return [*message_options(max_message_bytes), ("grpc.enable_retries", 0)]


class StoreClient:
    def __init__(self, address: str, token: str | None = None, tls_ca: str | None = None,
                 timeout_s: float = 5.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE, shm: bool = True) -> None:
        """`shm`: on the server's host, take bulk Gets through its shared-memory ring."""
        self.address = address
        self.shm = shm
        self.timeout_s = timeout_s
        options = channel_options(max_message_bytes)
        if tls_ca:
            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = cache_pb2_grpc.KVCacheStub(self.channel)
        # Get's replies are parsed by hand: one copy of each blob instead of two.
        self._get = self.channel.unary_stream("/tiered_cache.v1.KVCache/Get",
                                              request_serializer=pb.GetRequest.SerializeToString,
                                              response_deserializer=parse_page_blob)
        # Put's items are serialized by hand too (framing.page_blob_message).
        self._put = self.channel.stream_unary("/tiered_cache.v1.KVCache/Put", request_serializer=_put_item,
                                              response_deserializer=pb.PutResponse.FromString)
        token = check_token(token, "the store server token")
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._options, self._tls_ca = options, tls_ca  # for the aio channel of get_all
        self._fetcher: AioFetcher | None = None  # the aio channel of get_all, opened on first use
        self._fetcher_lock = threading.Lock()

    def lookup(self, keys: list[bytes], timeout_s: float | None = None, ring: ShmReader | None = None
               ) -> pb.LookupResponse:
        """Which keys the server holds. With `ring` (`ring_reader`), the reply also says where
        held pages lie in the server's shared-memory ring (`shm_positions`, `shm_lengths`)."""
        request = pb.LookupRequest(keys=keys, shm_segment=ring.segment if ring is not None else b"")
        return self.stub.Lookup(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)

    @property
    def ring_reader(self) -> ShmReader | None:
        """The server's ring as mapped here (after a first bulk Get found it on this host), or None."""
        fetcher = self._fetcher
        return fetcher.reader if fetcher is not None and not fetcher.stale else None

    def get(self, keys: list[bytes], fingerprint: bytes = b"", timeout_s: float | None = None,
            budget_s: float | None = None) -> Iterator[ReceivedBlob]:
        """The held blobs among `keys`, streamed in order (a missing key is skipped). Raises
        `StreamStalled` when no blob arrives for `timeout_s`; `budget_s` bounds the whole call."""
        call = self._get(pb.GetRequest(keys=keys, fingerprint=fingerprint), timeout=budget_s, metadata=self.metadata)
        watch = ProgressDeadline(call, timeout_s or self.timeout_s, f"Get of {len(keys)} pages from {self.address}")
        try:
            for item in call:
                watch.progress()
                yield item
        except grpc.RpcError as exc:
            if watch.stalled:
                raise watch.error() from exc
            raise
        finally:
            watch.close()
            call.cancel()  # a consumer that stops early frees the stream at once (no-op when done)

    def get_all(self, keys: list[bytes], fingerprint: bytes = b"", timeout_s: float | None = None,
                budget_s: float | None = None, on_blob: Callable[[ReceivedBlob], None] | None = None,
                lease: ShmLease | None = None) -> FetchResult:
        """Like `get`, but the whole stream at once, read on an aio channel (faster for bulk
        fetches: see aio_fetch.py); the error that ended it, if any, is returned, not raised.
        With `lease`, pages that come through the server's ring are lent as views into it (see
        `ShmLease`: check `lease.lost()` after copying them)."""
        with self._fetcher_lock:
            if self._fetcher is None:
                self._fetcher = AioFetcher(self.address, self._options, self._tls_ca, self.metadata, StreamStalled)
                if self.shm:
                    self._fetcher.reader = self.attach()
            elif self._fetcher.stale:  # the server restarted: its ring is another segment
                self._fetcher.stale = False
                # Not closed here: a Get on another thread may still be reading it (it unmaps
                # when the last reference goes).
                self._fetcher.reader = self.attach()
        return self._fetcher.get_all(keys, fingerprint, timeout_s or self.timeout_s, budget_s, on_blob, lease)

    @property
    def shm_overruns(self) -> int:
        """Pages the server's ring wrapped over before this client copied them (asked again as bytes)."""
        return self._fetcher.overruns if self._fetcher is not None else 0

    @property
    def uses_shm(self) -> bool:
        return self._fetcher is not None and self._fetcher.reader is not None

    def attach(self) -> ShmReader | None:
        """The server's shared-memory ring, mapped read-only, when the server offers one and runs
        on this host as this user; None otherwise (Get then moves bytes, as to any other host)."""
        try:
            reply = self.stub.Attach(pb.AttachRequest(), timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError:
            return None  # down, or a server without Attach: bytes
        if not reply.path or not reply.host or reply.host != host_identity():
            return None
        try:
            return ShmReader(reply.path, reply.size, reply.segment)
        except (OSError, ValueError):
            return None  # another container, another user, or the pid is not the server's any more

    def put(self, items: Iterable[tuple[bytes, bytes]], fingerprint: bytes = b"",
            timeout_s: float | None = None, budget_s: float | None = None) -> pb.PutResponse:
        """Stream pages to the server and return its ack. Raises `StreamStalled` when the server
        takes no page for `timeout_s` (or does not answer that long after the last)."""
        watch: ProgressDeadline | None = None

        def stream() -> Iterator[tuple[bytes, bytes, bytes]]:
            for k, b in items:
                yield k, b, fingerprint
                if watch is not None:
                    watch.progress()  # the previous page was taken: flow control let it go

        future = self._put.future(stream(), timeout=budget_s, metadata=self.metadata)
        watch = ProgressDeadline(future, timeout_s or self.timeout_s, f"Put to {self.address}")
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
        self.channel.close()
        if self._fetcher is not None:
            self._fetcher.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _put_item(item: tuple[bytes, bytes, bytes]) -> bytes:
    return page_blob_message(*item)
