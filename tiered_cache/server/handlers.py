"""The `tiered_cache.v1.KVCache` handlers, as asyncio coroutines over a `BlobStore`.

The event loop only parses, checks and moves messages; every store call (which may read disk or
Redis, and checksums blobs) runs on a thread pool: `io` for Get and Put data, a small `meta` pool
for Lookup and Stats, so a Lookup never queues behind another client's multi-GiB Get. A stream
that stalls is a parked coroutine, not a held thread, and is ended after `stream_idle_s`.

Requests are parsed by our own deserializers, so a malformed message gets INVALID_ARGUMENT with
a message a person can act on (grpc's default answer to an unparsable request is a bare
INTERNAL). Every refusal is counted in the server's stats.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from tiered_cache import __version__
from tiered_cache.index.keys import KEY_BYTES
from tiered_cache.server.config import ServerConfig
from tiered_cache.server.store import BlobStore
from tiered_cache.server.streams import BatchSizer, StreamSlots
from tiered_cache.shm.arena import Ref
from tiered_cache.shm.host import host_identity
from tiered_cache.shm.offers import OfferedSegments
from tiered_cache.tiers.arena import ArenaTier
from tiered_cache.tiers.base import TierStats
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire.codec import BlobError, BlobFault, check_fingerprint, read_header, verify_blob
from tiered_cache.wire.deadline import ProgressDeadline
from tiered_cache.wire.framing import page_blob_message, page_ref_message, parse_page_blob

T = TypeVar("T")
_TIERS = {"ram": pb.TIER_RAM, "disk": pb.TIER_DISK, "redis": pb.TIER_REDIS}
_NOT_IN_PROTO = {"hit_rate", "breakers"}  # derived, or per server (the counts travel instead)
_REFUSALS = {
    BlobFault.CORRUPT: pb.CORRUPT_BLOB, BlobFault.WRONG_KEY: pb.KEY_MISMATCH,
    BlobFault.WRONG_FINGERPRINT: pb.FINGERPRINT_MISMATCH, BlobFault.UNKNOWN_CODEC: pb.UNKNOWN_CODEC,
    BlobFault.WRONG_SHAPE: pb.CORRUPT_BLOB,
}


@dataclass
class Malformed:
    """What our deserializer returns for bytes that are not the expected message."""

    message_type: str
    size: int


def parse_put_item(data: bytes) -> Any:
    """A Put stream item (`PageBlob`), parsed by hand: one copy of the blob instead of two."""
    try:
        return parse_page_blob(data)
    except ValueError:
        return Malformed(pb.PageBlob.DESCRIPTOR.full_name, len(data))


def parser(message_cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError):
            return Malformed(message_cls.DESCRIPTOR.full_name, len(data))
    return parse


class ServerCounters:
    """Figures of the server itself. Only the event loop's thread changes them (no lock)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.requests = self.rejected = self.unauthenticated = self.refused_blobs = self.stalled_streams = 0
        self.shm_put_pages = 0  # Put pages read from clients' offered segments
        self.shm_pages = 0  # pages handed to same-host clients as refs into the arena (Lookup or Get)
        self.shm_pages_reused = 0  # of which already in the arena: handed out with no copy at all


class KVCacheService:
    def __init__(self, store: BlobStore, config: ServerConfig, counters: ServerCounters,
                 io: Executor, meta: Executor, arena: ArenaTier | None = None,
                 offers: OfferedSegments | None = None) -> None:
        self.store = store
        self.config = config
        self.counters = counters
        self.slots = StreamSlots(config.max_streams)
        self.arena = arena  # the RAM tier in shared memory, when on: same-host clients read it in place
        self.offers = offers  # same-host Put through clients' segments, when on
        self._io = io
        self._meta = meta

    # --- helpers -------------------------------------------------------------------------------
    async def _run(self, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _reject(self, context: grpc.aio.ServicerContext, message: str) -> None:
        self.counters.rejected += 1
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    async def _refuse_malformed(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Malformed):
            await self._reject(context, f"request is not a valid {request.message_type} ({request.size} bytes)")

    async def _take_unary(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Count a keyless unary call (Stats, Attach); refuse it when it did not parse."""
        self.counters.requests += 1
        await self._refuse_malformed(request, context)

    async def _check_keys(self, request: Any, context: grpc.aio.ServicerContext) -> list[bytes]:
        await self._refuse_malformed(request, context)
        keys = list(request.keys)
        if len(keys) > self.config.max_keys:
            await self._reject(context, f"{len(keys)} keys in one request; the limit is {self.config.max_keys}")
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                await self._reject(context, f"key {i} is {len(key)} bytes; page keys are {KEY_BYTES} bytes (SHA-256)")
        return keys

    def _count_stalled(self, context: grpc.aio.ServicerContext, watch: ProgressDeadline) -> None:
        """A stream made no progress: count it and say why in its status, if one can still be
        sent (a client that reads nothing gets the stream reset instead)."""
        self.counters.stalled_streams += 1
        context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
        context.set_details(f"{watch.what} for {watch.idle_s:g} s: stream ended (the server's stream_idle_s)")

    # --- RPCs ----------------------------------------------------------------------------------
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        self.counters.requests += 1
        keys = await self._check_keys(request, context)
        arena = self._arena_for(request)
        where, refs = await self._run(self._meta, self._locate, keys, arena)
        handed = sum(ref is not None for ref in refs)
        self.counters.shm_pages += handed
        self.counters.shm_pages_reused += handed
        tiers = [_TIERS.get(w, pb.TIER_RAM) if w else pb.TIER_NONE for w in where]
        leading = next((i for i, w in enumerate(where) if w is None), len(where))
        return pb.LookupResponse(leading=leading, tiers=tiers, shm_positions=[r[0] if r else 0 for r in refs],
                                 shm_lengths=[r[1] if r else 0 for r in refs])

    def _arena_for(self, request: Any) -> ArenaTier | None:
        """The arena, when the request names it (a client on this host that mapped it)."""
        arena = self.arena
        return arena if arena is not None and request.shm_segment == arena.id else None

    def _locate(self, keys: list[bytes], arena: ArenaTier | None) -> tuple[list[str | None], list[Ref | None]]:
        """Where each key is held, and (for a client that mapped `arena`) where those in the
        arena lie, leased for the read that usually follows; no refs without an arena. Pages held
        below are not brought up here: a Lookup stays cheap, the Get brings them."""
        where = self.store.locate(keys)
        if arena is None:
            return where, []
        in_ram = [i for i, w in enumerate(where) if w == arena.name]
        refs: list[Ref | None] = [None] * len(keys)
        for i, ref in zip(in_ram, arena.refs([keys[i] for i in in_ram], count_misses=False), strict=True):
            refs[i] = ref
        return where, refs

    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        self.counters.requests += 1
        keys = await self._check_keys(request, context)
        fingerprint = bytes(request.fingerprint)
        if fingerprint and len(fingerprint) != KEY_BYTES:
            await self._reject(context, f"fingerprint is {len(fingerprint)} bytes; expected 32 raw bytes")
        arena = self._arena_for(request)
        await self.slots.acquire(context)
        watch = ProgressDeadline.of_task(self.config.stream_idle_s, "the client read nothing")
        try:
            await self._stream_blobs(keys, fingerprint, context, watch, arena)
        except asyncio.CancelledError:
            if watch.stalled:
                self._count_stalled(context, watch)
            raise  # the call is cancelled (RST_STREAM): nothing waits behind the unread data
        finally:
            watch.close()
            self.slots.release()

    async def _stream_blobs(self, keys: list[bytes], fingerprint: bytes, context: grpc.aio.ServicerContext,
                            watch: ProgressDeadline, arena: ArenaTier | None) -> None:
        """Read the next batch from the store while the current one is sent: at most two batches
        of about `stream_buffer_bytes` each are held per stream. A write waits while the client
        is not reading (HTTP/2 flow control); the watch ends the stream when that lasts. With
        `arena`, pages go as refs into it (no copy), those held below brought into it first."""
        sizer = BatchSizer(self.config.stream_buffer_bytes)
        start = 0

        def next_batch() -> asyncio.Future[list[bytes]] | None:
            nonlocal start
            if start >= len(keys):
                return None
            chunk = keys[start:start + sizer.count]
            start += len(chunk)
            return asyncio.ensure_future(self._run(self._io, self._read_batch, chunk, fingerprint, sizer, arena))

        pending = next_batch()
        try:
            while pending is not None:
                messages, handed, reused = await pending
                self.counters.shm_pages += handed
                self.counters.shm_pages_reused += reused
                pending = next_batch()
                for message in messages:
                    await context.write(message)
                    watch.progress()
        finally:
            if pending is not None:
                pending.cancel()

    def _read_batch(self, chunk: list[bytes], fingerprint: bytes, sizer: BatchSizer,
                    arena: ArenaTier | None) -> tuple[list[bytes], int, int]:
        """The Get messages of one batch (on the io pool: reads and framing off the loop), with
        how many pages went as refs into the arena and how many of those were there already."""
        if arena is None:
            refs: list[Ref | None] = [None] * len(chunk)
            blobs, reused = self.store.get(chunk), 0
        else:
            refs, blobs, reused = self.store.arena_refs(chunk)
        messages = []
        for key, ref, blob in zip(chunk, refs, blobs, strict=True):
            if ref is not None:
                if fingerprint and not arena.matches(ref, lambda blob: _fingerprint_ok(blob, fingerprint)):
                    continue
                sizer.see(ref[1])
                messages.append(page_ref_message(key, *ref))
            elif blob is not None and not (fingerprint and not _fingerprint_ok(blob, fingerprint)):
                sizer.see(len(blob))
                messages.append(page_blob_message(key, blob))
        return messages, sum(ref is not None for ref in refs), reused

    async def Attach(self, request: Any, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        """Where a client on this host finds the arena (empty when shared memory is off)."""
        await self._take_unary(request, context)
        arena = self.arena
        if arena is None:
            return pb.AttachResponse(host=host_identity() if self.offers is not None else "")
        return pb.AttachResponse(path=arena.path, size=arena.size, segment=arena.id, host=host_identity())

    async def Offer(self, request: Any, context: grpc.aio.ServicerContext) -> pb.OfferResponse:
        """Map a same-host client's own segment for its Puts (shm/offers.py says what is accepted)."""
        await self._take_unary(request, context)
        if self.offers is None:
            return pb.OfferResponse(accepted=False, reason="shared memory is off on this server (serve --shm off)")
        reason = await self._run(self._meta, self.offers.offer, request.path, request.size, bytes(request.segment),
                                 request.host, context.peer())
        return pb.OfferResponse(accepted=not reason, reason=reason)

    async def Put(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        self.counters.requests += 1
        await self.slots.acquire(context)
        response = pb.PutResponse()
        sizer = BatchSizer(self.config.stream_buffer_bytes)
        batch: list[Any] = []
        nbytes = 0
        watch = ProgressDeadline.of_task(self.config.stream_idle_s, "no page received")
        storing: asyncio.Future[None] | None = None  # one batch stored while the next is read
        try:
            while True:
                item = await context.read()
                watch.progress()
                if item is grpc.aio.EOF:
                    break
                if isinstance(item, Malformed):
                    await self._after(storing)
                    await self._store_batch(batch, response)
                    await self._reject(context, f"stream item is not a valid {item.message_type} "
                                                f"({item.size} bytes); {response.stored} pages stored before it")
                batch.append(item)
                nbytes += len(item.blob)
                if sizer.full(len(batch), nbytes):
                    await self._after(storing)
                    storing = asyncio.ensure_future(self._store_batch(batch[:], response))
                    batch.clear()
                    nbytes = 0
            await self._after(storing)
            storing = None
            await self._store_batch(batch, response)
        except asyncio.CancelledError:
            if not watch.stalled:
                raise  # the client cancelled, or the server is stopping
            self._count_stalled(context, watch)
            # The way back is open (only the client's side is idle): end with the status.
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, context.details())
        finally:
            watch.close()
            if storing is not None:
                storing.cancel()
            self.slots.release()
        return response

    @staticmethod
    async def _after(storing: asyncio.Future[None] | None) -> None:
        if storing is not None:
            await storing

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        await self._take_unary(request, context)
        c = self.counters
        server = pb.ServerStats(version=__version__, uptime_s=time.monotonic() - c.started, requests=c.requests,
                                rejected_requests=c.rejected, unauthenticated=c.unauthenticated,
                                refused_blobs=c.refused_blobs, active_streams=self.slots.active,
                                refused_streams=self.slots.refused, stalled_streams=c.stalled_streams,
                                shm_pages=c.shm_pages, shm_pages_reused=c.shm_pages_reused,
                                shm_put_pages=c.shm_put_pages,
                                shm_offers=len(self.offers) if self.offers is not None else 0)
        tiers = [pb.TierStats(**{k: v for k, v in s.to_dict().items() if k not in _NOT_IN_PROTO})
                 for s in await self._tiers_stats()]
        return pb.StatsResponse(tiers=tiers, server=server)

    async def _tiers_stats(self) -> list[TierStats]:
        """The tiers' figures, on the meta pool: no data lock is taken (tiers report counters), and
        a Redis tier asks INFO at most once a second by itself (tiers/redis.py)."""
        return await self._run(self._meta, self.store.stats)

    # --- Put internals -------------------------------------------------------------------------
    async def _store_batch(self, batch: list[Any], response: pb.PutResponse) -> None:
        if not batch:
            return
        items = [(item.key, item.blob, item.fingerprint) for item in batch]
        batch.clear()
        refused, stored, held = await self._run(self._io, self._check_and_store, items)
        response.refused.extend(refused)
        response.stored += stored
        response.already_held += held
        self.counters.refused_blobs += len(refused)

    async def PutOffered(self, request: Any, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """Store pages that lie in the caller's offered segment (shm/offers.py): copied out and
        verified on the io pool like any Put's blobs, a batch of about `stream_buffer_bytes` at a
        time (so a request naming the same GiB over and over holds no more than a Put stream)."""
        self.counters.requests += 1
        await self._refuse_malformed(request, context)
        if len(request.pages) > self.config.max_keys:
            await self._reject(context, f"{len(request.pages)} pages in one request; "
                                        f"the limit is {self.config.max_keys}")
        await self.slots.acquire(context)
        try:
            response = pb.PutResponse()
            copied = await self._run(self._io, self._store_offered, request, response)
            self.counters.shm_put_pages += copied
            self.counters.refused_blobs += len(response.refused)
            return response
        finally:
            self.slots.release()

    def _store_offered(self, request: Any, response: pb.PutResponse) -> int:
        """On the io pool: check and store the offered pages where they lie in the client's ring,
        batch by batch (one copy each, into the store); a refusal for each page lost, before or
        during its copy (then dropped from the store again). Returns how many were taken."""
        segment, fingerprint = bytes(request.segment), bytes(request.fingerprint)
        offers = self.offers  # once: stop() clears it
        if offers is not None:
            offers.sweep()
        sizer = BatchSizer(self.config.stream_buffer_bytes)
        batch: list[tuple[bytes, bytes | memoryview, bytes]] = []
        where: list[tuple[Any, int, int]] = []  # each batch item's ring, position, length
        nbytes = copied = 0

        def store() -> None:
            nonlocal nbytes
            refused, stored, held = self._check_and_store(batch)
            # Copied where they lay: a page the client's ring came round over meanwhile may be
            # torn in the store. Dropped again, and refused as lost (the client sends it as bytes).
            refused_keys = {r.key for r in refused}
            lost = [key for (key, _, _), (ring, position, length) in zip(batch, where, strict=True)
                    if key not in refused_keys and not ring.intact(position, length)]
            if lost:
                self.store.delete(lost)
                refused += [pb.Refusal(key=key, reason=pb.SHM_LOST, message="the client's ring came round over the "
                                       "page while the server copied it") for key in lost]
                from_stored = min(stored, len(lost))  # the ack still counts each page once
                stored, held = stored - from_stored, held - (len(lost) - from_stored)
            response.refused.extend(refused)
            response.stored += stored
            response.already_held += held
            batch.clear()
            where.clear()
            nbytes = 0

        def refuse(refusal: pb.Refusal) -> None:
            if batch:
                store()  # first: refusals stay in the order of the pages
            response.refused.append(refusal)

        for page in request.pages:
            key = bytes(page.key)
            if page.length > self.config.max_page_bytes:
                limit = self.config.max_page_bytes
                refuse(pb.Refusal(key=key, reason=pb.TOO_LARGE,
                                  message=f"blob is {page.length:,} bytes; this server takes at most {limit:,}"))
                continue
            if offers is None:
                data, ring, why = None, None, "shared memory is off on this server (serve --shm off); send bytes by Put"
            else:
                data, ring, why = offers.view(segment, page.position, page.length)
            if data is None:
                refuse(pb.Refusal(key=key, reason=pb.SHM_LOST, message=why))
                continue
            copied += 1
            batch.append((key, data, fingerprint))
            where.append((ring, page.position, page.length))
            nbytes += len(data)
            if sizer.full(len(batch), nbytes):
                store()
        if batch:
            store()
        return copied

    def _check_and_store(self, items: Sequence[tuple[bytes, bytes | memoryview, bytes]]
                         ) -> tuple[list[pb.Refusal], int, int]:
        """On the io pool: verify each blob (checksums are CPU work), store those that pass."""
        refused, good = [], []
        for key, blob, fingerprint in items:
            refusal = self._validate(key, blob, fingerprint)
            if refusal is None:
                good.append((key, blob))
            else:
                refused.append(refusal)
        stored, held = self.store.put(good) if good else (0, 0)
        return refused, stored, held

    def _validate(self, key: bytes, blob: bytes | memoryview, fingerprint: bytes) -> pb.Refusal | None:
        if len(key) != KEY_BYTES:
            return pb.Refusal(key=key, reason=pb.BAD_KEY, message=f"key is {len(key)} bytes, expected {KEY_BYTES}")
        if len(blob) > self.config.max_page_bytes:
            return pb.Refusal(key=key, reason=pb.TOO_LARGE,
                              message=f"blob is {len(blob):,} bytes; this server takes at most "
                                      f"{self.config.max_page_bytes:,}")
        if not self.store.fits(len(blob)):
            return pb.Refusal(key=key, reason=pb.NO_SPACE,
                              message=f"blob is {len(blob):,} bytes, more than the RAM tier holds, and no tier "
                                      f"is below it")
        try:
            header = verify_blob(blob, key)
            if fingerprint:
                check_fingerprint(header, fingerprint)
        except BlobError as exc:
            return pb.Refusal(key=key, reason=_REFUSALS[exc.fault], message=str(exc))
        return None


def _fingerprint_ok(blob: bytes, fingerprint: bytes) -> bool:
    try:
        check_fingerprint(read_header(blob, check_crc=False), fingerprint)
    except BlobError:
        return False
    return True
