"""The store's write handlers: Put, and same-host Put through a client's own ring (Offer,
PutOffered).

Every blob is verified before it is stored (checksums are CPU work: on the io pool), a batch of
about `stream_buffer_bytes` at a time, the next batch read while the last one is stored; a blob
that fails is refused with its reason, never stored. A Put stream that sends nothing for
`stream_idle_s` is ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from tiered_cache.index.keys import KEY_BYTES
from tiered_cache.server.requests import Malformed, Requests
from tiered_cache.server.status import end_call
from tiered_cache.server.store import BlobStore
from tiered_cache.server.streams import BatchSizer
from tiered_cache.shm.offers import OfferedSegments
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire.blob_geometry import check_geometry
from tiered_cache.wire.codec import BlobError, BlobFault, check_fingerprint, rekeyed, verify_blob
from tiered_cache.wire.deadline import ProgressDeadline
from tiered_cache.wire.namespaces import scoped_key

_REFUSALS = {
    BlobFault.CORRUPT: pb.CORRUPT_BLOB, BlobFault.WRONG_KEY: pb.KEY_MISMATCH,
    BlobFault.WRONG_FINGERPRINT: pb.FINGERPRINT_MISMATCH, BlobFault.UNKNOWN_CODEC: pb.UNKNOWN_CODEC,
    BlobFault.WRONG_SHAPE: pb.CORRUPT_BLOB,
}


class PutHandlers:
    def __init__(self, requests: Requests, store: BlobStore, offers: OfferedSegments | None = None) -> None:
        self.requests = requests
        self.store = store
        self.offers = offers  # same-host Put through clients' segments, when on

    async def Offer(self, request: Any, context: grpc.aio.ServicerContext) -> pb.OfferResponse:
        """Map a same-host client's own segment for its Puts (shm/offers.py says what is accepted)."""
        r = self.requests
        await r.take_unary(request, context)
        if self.offers is None:
            return pb.OfferResponse(accepted=False, reason="shared memory is off on this server (serve --shm off)")
        if await r.namespace(context):
            return pb.OfferResponse(accepted=False, reason="same-host shared memory is offered only to calls in the "
                                                           "empty namespace: send pages by Put")
        reason = await r.run(r.meta, self.offers.offer, request.path, request.size, bytes(request.segment),
                             request.host, context.peer())
        return pb.OfferResponse(accepted=not reason, reason=reason)

    async def Put(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        r = self.requests
        r.counters.requests += 1
        namespace = await r.namespace(context)
        await r.permits.acquire(context)
        response = pb.PutResponse()
        sizer = BatchSizer(r.config.stream_buffer_bytes)
        batch: list[Any] = []
        nbytes = 0
        watch = ProgressDeadline.of_task(r.config.stream_idle_s, "no page received")
        storing: asyncio.Future[None] | None = None  # one batch stored while the next is read
        try:
            while True:
                item = await context.read()
                watch.progress()
                if item is grpc.aio.EOF:
                    break
                if isinstance(item, Malformed):
                    await self._after(storing)
                    await self._store_batch(batch, response, namespace)
                    await r.reject(context, f"stream item is not a valid {item.message_type} "
                                            f"({item.size} bytes); {response.stored} pages stored before it")
                batch.append(item)
                nbytes += len(item.blob)
                if sizer.full(len(batch), nbytes):
                    await self._after(storing)
                    storing = asyncio.ensure_future(self._store_batch(batch[:], response, namespace))
                    batch.clear()
                    nbytes = 0
            await self._after(storing)
            storing = None
            await self._store_batch(batch, response, namespace)
        except asyncio.CancelledError:
            if not watch.stalled:
                r.count_cancelled("Put")
                raise  # the client cancelled, or the server is stopping
            r.count_stalled(context, watch)
            # The way back is open (only the client's side is idle): end with the status.
            await end_call(context, grpc.StatusCode.DEADLINE_EXCEEDED, context.details())
        finally:
            watch.close()
            if storing is not None:
                storing.cancel()
            r.permits.release()
        return response

    @staticmethod
    async def _after(storing: asyncio.Future[None] | None) -> None:
        if storing is not None:
            await storing

    async def _store_batch(self, batch: list[Any], response: pb.PutResponse, namespace: str) -> None:
        if not batch:
            return
        r = self.requests
        items = [(item.key, item.blob, item.fingerprint) for item in batch]
        batch.clear()
        refused, stored, held = await r.run(r.io, self._check_and_store, items, namespace)
        response.refused.extend(refused)
        response.stored += stored
        response.already_held += held
        r.counters.refused_blobs += len(refused)

    async def PutOffered(self, request: Any, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """Store pages that lie in the caller's offered segment (shm/offers.py): copied out and
        verified on the io pool like any Put's blobs, a batch of about `stream_buffer_bytes` at a
        time (so a request naming the same GiB over and over holds no more than a Put stream)."""
        r = self.requests
        r.counters.requests += 1
        await r.refuse_malformed(request, context)
        if await r.namespace(context):  # as Offer: shared memory only in the empty namespace
            await r.reject(context, "same-host shared memory is offered only to calls in the empty namespace: "
                                    "send pages by Put")
        if len(request.pages) > r.config.max_keys:
            await r.reject(context, f"{len(request.pages)} pages in one request; "
                                    f"the limit is {r.config.max_keys}")
        await r.permits.acquire(context)
        try:
            response = pb.PutResponse()
            copied = await r.run(r.io, self._store_offered, request, response)
            r.counters.shm_put_pages += copied
            r.counters.refused_blobs += len(response.refused)
            return response
        finally:
            r.permits.release()

    def _store_offered(self, request: Any, response: pb.PutResponse) -> int:
        """On the io pool: check and store the offered pages where they lie in the client's ring,
        batch by batch (one copy each, into the store); a refusal for each page lost, before or
        during its copy (then dropped from the store again). Returns how many were taken."""
        segment, fingerprint = bytes(request.segment), bytes(request.fingerprint)
        offers = self.offers  # once: stop() clears it
        if offers is not None:
            offers.sweep()
        config = self.requests.config
        sizer = BatchSizer(config.stream_buffer_bytes)
        batch: list[tuple[bytes, bytes | memoryview, bytes]] = []
        where: list[tuple[Any, int, int]] = []  # each batch item's ring, position, length
        nbytes = copied = 0

        def store() -> None:
            nonlocal nbytes
            refused, stored, held = self._check_and_store(batch, "")
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
            if page.length > config.max_page_bytes:
                limit = config.max_page_bytes
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

    def _check_and_store(self, items: Sequence[tuple[bytes, bytes | memoryview, bytes]], namespace: str
                         ) -> tuple[list[pb.Refusal], int, int]:
        """On the io pool: verify each blob (checksums are CPU work), store those that pass under
        their keys in `namespace` (`scoped_key`; the blob is made to carry that key)."""
        refused, good = [], []
        for key, blob, fingerprint in items:
            refusal = self._validate(key, blob, fingerprint)
            if refusal is None:  # kept under the namespace's key, which the blob then carries (tiers check it)
                kept = scoped_key(namespace, key)
                good.append((kept, rekeyed(blob, kept) if namespace else blob))
            else:
                refused.append(refusal)
        stored, held = self.store.put(good) if good else (0, 0)
        return refused, stored, held

    def _validate(self, key: bytes, blob: bytes | memoryview, fingerprint: bytes) -> pb.Refusal | None:
        max_page_bytes = self.requests.config.max_page_bytes
        if len(key) != KEY_BYTES:
            return pb.Refusal(key=key, reason=pb.BAD_KEY, message=f"key is {len(key)} bytes, expected {KEY_BYTES}")
        if len(blob) > max_page_bytes:
            return pb.Refusal(key=key, reason=pb.TOO_LARGE,
                              message=f"blob is {len(blob):,} bytes; this server takes at most "
                                      f"{max_page_bytes:,}")
        if not self.store.fits(len(blob)):
            return pb.Refusal(key=key, reason=pb.NO_SPACE,
                              message=f"blob is {len(blob):,} bytes, more than the RAM tier holds, and no tier "
                                      f"is below it")
        try:
            header = verify_blob(blob, key)
            if fingerprint:
                check_fingerprint(header, fingerprint)
            check_geometry(blob, header)
        except BlobError as exc:
            return pb.Refusal(key=key, reason=_REFUSALS[exc.fault], message=str(exc))
        return None
