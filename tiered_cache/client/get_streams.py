"""The store client's one Get: a stream on a grpc.aio channel (`GetStreams`), read whole
(`get_whole`: every blob of a stream at once, what the remote tier uses) or a blob at a time
(`stream`: `StoreClient.get`).

The sync gRPC client hands each received message from its polling thread to the consumer (a
thread switch and a GIL hand-off per message); the aio client reads the whole stream on one
event loop, which moves bulk streams faster (docs/PERFORMANCE.md, "The store under many
clients"). One event loop thread per process serves
every `GetStreams`; each owns an aio channel bound to that loop.

With `reader` (the server's arena, mapped: shm/arena_map.py) pages come as refs into it and are
copied out, or with `ArenaViews` lent as views into it; a page the arena wrote over before it was
read is asked again as bytes.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from tiered_cache.shm.arena_map import ArenaMap, ArenaViews
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire.deadline import ProgressDeadline
from tiered_cache.wire.framing import ReceivedBlob, parse_page_blob

_GET = "/tiered_cache.v1.KVCache/Get"
READ_AHEAD = 32  # blobs `GetStreams.stream` reads ahead of its caller at most
READ_AHEAD_BYTES = 2 * 2**20  # and bytes
_END = object()  # `stream`'s end of the stream


class _Loop:
    """The process's event loop for aio clients, on a daemon thread started on first use."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="tiered-cache-aio-client", daemon=True).start()
                cls._loop = loop
            return cls._loop


class GetResult:
    """What a bulk Get received: the blobs in stream order, and the error that ended it early
    (None when the stream completed). Blobs received before an error stay usable."""

    def __init__(self, blobs: list[ReceivedBlob], error: grpc.RpcError | None) -> None:
        self.blobs, self.error = blobs, error


class GetStreams:
    """The Get streams of one store client, on one aio channel of its own."""

    def __init__(self, address: str, options: list[tuple[str, int]], tls_ca: str | None,
                 metadata: tuple[tuple[str, str], ...]) -> None:
        self.address = address
        self.metadata = metadata
        self._loop = _Loop.get()
        self.reader: ArenaMap | None = None  # the server's arena, when it is on this host
        self.stale = False  # the server no longer takes `reader`'s segment (it restarted): attach again
        self.overruns = 0  # pages the arena wrote over before they were copied out (asked again as bytes)
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes()) if tls_ca else None
        self._channel, self._get = self._on_loop(self._open(address, options, creds))

    @staticmethod
    async def _open(address: str, options: list[tuple[str, int]], creds: Any) -> tuple[Any, Any]:
        channel = (grpc.aio.secure_channel(address, creds, options=options) if creds is not None
                   else grpc.aio.insecure_channel(address, options=options))
        get = channel.unary_stream(_GET, request_serializer=pb.GetRequest.SerializeToString,
                                   response_deserializer=parse_page_blob)
        return channel, get

    def _on_loop(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def stream(self, keys: list[bytes], fingerprint: bytes, idle_s: float, budget_s: float | None
               ) -> Iterator[ReceivedBlob]:
        """The blobs the server streams for `keys`, handed over one at a time as the caller asks
        for the next, as bytes (no arena refs asked for). The loop reads ahead of the caller by at
        most `READ_AHEAD` blobs and `READ_AHEAD_BYTES`: one that stops reading holds the stream
        (HTTP/2 flow control) and is ended by the progress deadline. Raises `StreamStalled` when
        nothing arrives for `idle_s` and gRPC's error when the call fails; a caller that stops
        early ends the call."""
        received: queue.SimpleQueue[Any] = queue.SimpleQueue()
        ahead = _ReadAhead()
        request = pb.GetRequest(keys=keys, fingerprint=fingerprint)
        what = f"Get of {len(keys)} pages from {self.address}"
        pump = asyncio.run_coroutine_threadsafe(self._pump(request, idle_s, budget_s, what, ahead, received),
                                                self._loop)
        count = nbytes = 0  # taken since last handed back (one wake-up of the loop per half a window)
        try:
            while True:
                item = received.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                count, nbytes = count + 1, nbytes + len(item.blob)
                if count >= READ_AHEAD // 2 or nbytes >= READ_AHEAD_BYTES // 2:
                    self._loop.call_soon_threadsafe(ahead.taken, count, nbytes)
                    count = nbytes = 0
                yield item
        finally:
            pump.cancel()  # a consumer that stops early frees the stream at once (no-op when done)

    async def _pump(self, request: Any, idle_s: float, budget_s: float | None, what: str,
                    ahead: _ReadAhead, received: queue.SimpleQueue[Any]) -> None:
        """`stream`'s reader, on the loop: each blob into `received`, then `_END` or the error."""
        call = self._get(request, timeout=budget_s, metadata=self.metadata)
        watch = ProgressDeadline.of_task(idle_s, what)
        try:
            async for item in call:
                watch.progress()
                received.put(item)
                await ahead.put(len(item.blob))
            received.put(_END)
        except asyncio.CancelledError:  # stalled, or the caller stopped reading (then nobody reads this)
            call.cancel()
            received.put(watch.error() if watch.stalled else grpc.aio.AioRpcError(
                grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "the Get was cancelled"))
        except grpc.RpcError as exc:
            received.put(exc)
        finally:
            watch.close()

    def get_whole(self, keys: list[bytes], fingerprint: bytes, idle_s: float, budget_s: float | None,
                  on_blob: Callable[[ReceivedBlob], None] | None = None, lease: ArenaViews | None = None) -> GetResult:
        """Every blob the server streams for `keys`. The stream fails when nothing arrives for
        `idle_s` (progress deadline) or, when set, past `budget_s`. `on_blob` runs on the loop's
        thread as each blob arrives (e.g. to start its checksum elsewhere): keep it short. With
        `lease`, arena pages are views recorded in it, not copies (see `ArenaViews`)."""
        return self._on_loop(self._get_whole(keys, fingerprint, idle_s, budget_s, on_blob, lease))

    async def _get_whole(self, keys: list[bytes], fingerprint: bytes, idle_s: float, budget_s: float | None,
                         on_blob: Callable[[ReceivedBlob], None] | None, lease: ArenaViews | None) -> GetResult:
        blobs: list[ReceivedBlob] = []
        lost, error = await self._stream(keys, fingerprint, idle_s, budget_s, on_blob, self.reader, blobs, lease)
        if lost and error is None:
            self.overruns += len(lost)
            _, error = await self._stream(lost, fingerprint, idle_s, budget_s, on_blob, None, blobs, None)
        return GetResult(blobs, error)

    async def _stream(self, keys: list[bytes], fingerprint: bytes, idle_s: float, budget_s: float | None,
                      on_blob: Callable[[ReceivedBlob], None] | None, reader: ArenaMap | None,
                      blobs: list[ReceivedBlob], lease: ArenaViews | None) -> tuple[list[bytes], grpc.RpcError | None]:
        """One Get stream into `blobs`: the keys whose pages the arena wrote over, and the error that
        ended the stream (None when it completed)."""
        request = pb.GetRequest(keys=keys, fingerprint=fingerprint, shm_segment=reader.segment if reader else b"")
        call = self._get(request, timeout=budget_s, metadata=self.metadata)
        what = f"Get of {len(keys)} pages from {self.address}"
        watch = ProgressDeadline.of_task(idle_s, what)  # one timer per stream, not a wait_for per message
        lost: list[bytes] = []
        try:
            async for item in call:
                watch.progress()
                if item.shm is not None:
                    data = (None if reader is None else reader.view(*item.shm) if lease is not None
                            else reader.read(*item.shm))
                    if data is None:
                        lost.append(item.key)
                        continue
                    if lease is not None:
                        lease.add(item.key, reader, *item.shm)
                    item.blob, item.shm = data, None
                elif reader is not None and 0 < len(item.blob) <= reader.max_page:
                    self.stale = True  # a page the arena would take came as bytes: not our arena
                blobs.append(item)
                if on_blob is not None:
                    on_blob(item)
            return lost, None
        except asyncio.CancelledError:
            if not watch.stalled:
                raise
            call.cancel()
            return lost, watch.error()
        except grpc.RpcError as exc:
            return lost, exc
        finally:
            watch.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._on_loop(self._channel.close())
        if self.reader is not None:
            self.reader.close()
            self.reader = None


class _ReadAhead:
    """How far `stream`'s reader is ahead of its caller (blobs and bytes it read that the caller
    has not handed back); `put` waits, on the loop, while that is a whole window."""

    def __init__(self) -> None:
        self.count = self.nbytes = 0
        self._room = asyncio.Event()
        self._room.set()

    async def put(self, nbytes: int) -> None:
        self.count, self.nbytes = self.count + 1, self.nbytes + nbytes
        if self.count >= READ_AHEAD or self.nbytes >= READ_AHEAD_BYTES:
            self._room.clear()
            await self._room.wait()

    def taken(self, count: int, nbytes: int) -> None:
        self.count, self.nbytes = self.count - count, self.nbytes - nbytes
        if self.count < READ_AHEAD and self.nbytes < READ_AHEAD_BYTES:
            self._room.set()
