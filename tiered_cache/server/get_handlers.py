"""The store's read handlers: Lookup and Get.

A Get streams the pages it finds, reading the next batch from the store (on the io pool) while
the current one is sent; to a client on this host that mapped the arena, pages go as refs into it
instead of bytes. A client that stops reading is ended after `stream_idle_s` (its stream is a
parked coroutine meanwhile, not a held thread).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from tiered_cache.index.keys import KEY_BYTES
from tiered_cache.server.arena_tier import ArenaTier
from tiered_cache.server.requests import Requests
from tiered_cache.server.store import BlobStore
from tiered_cache.server.streams import BatchSizer, GetBatches
from tiered_cache.shm.arena import Ref
from tiered_cache.tiers.base import Tier
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire.codec import BlobError, check_fingerprint, read_header, rekeyed
from tiered_cache.wire.deadline import ProgressDeadline
from tiered_cache.wire.framing import page_blob_message, page_ref_message
from tiered_cache.wire.namespaces import scoped_keys

_TIERS = {Tier.RAM: pb.TIER_RAM, Tier.DISK: pb.TIER_DISK, Tier.REDIS: pb.TIER_REDIS}  # the wire's names for ours


class GetHandlers:
    def __init__(self, requests: Requests, store: BlobStore, arena: ArenaTier | None = None) -> None:
        self.requests = requests
        self.store = store
        self.arena = arena  # the RAM tier in shared memory, when on: same-host clients read it in place

    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        r = self.requests
        r.counters.requests += 1
        keys = await r.check_keys(request, context)
        namespace = await r.namespace(context)
        arena = self._arena_for(request, namespace)
        where, refs = await r.run(r.meta, self._locate, scoped_keys(namespace, keys), arena)
        handed = sum(ref is not None for ref in refs)
        r.counters.shm_pages += handed
        r.counters.shm_pages_reused += handed
        tiers = [_TIERS.get(w, pb.TIER_RAM) if w else pb.TIER_NONE for w in where]
        leading = next((i for i, w in enumerate(where) if w is None), len(where))
        return pb.LookupResponse(leading=leading, tiers=tiers, shm_positions=[ref[0] if ref else 0 for ref in refs],
                                 shm_lengths=[ref[1] if ref else 0 for ref in refs])

    def _arena_for(self, request: Any, namespace: str) -> ArenaTier | None:
        """The arena, when the request names it (a client on this host that mapped it) and acts in
        the empty namespace (a mapped arena shows every namespace's pages: server/tenants.py)."""
        arena = self.arena
        return arena if arena is not None and not namespace and request.shm_segment == arena.id else None

    def _locate(self, keys: list[bytes], arena: ArenaTier | None) -> tuple[list[str | None], list[Ref | None]]:
        """Where each key is held, and (for a client that mapped `arena`) where those in the
        arena lie, leased for the read that usually follows; no refs without an arena. Pages held
        below are not loaded into the arena here: a Lookup stays cheap, the Get loads them."""
        where = self.store.locate(keys)
        if arena is None:
            return where, []
        in_ram = [i for i, w in enumerate(where) if w == arena.name]
        refs: list[Ref | None] = [None] * len(keys)
        for i, ref in zip(in_ram, arena.refs([keys[i] for i in in_ram], count_misses=False), strict=True):
            refs[i] = ref
        return where, refs

    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        r = self.requests
        r.counters.requests += 1
        keys = await r.check_keys(request, context)
        fingerprint = bytes(request.fingerprint)
        if fingerprint and len(fingerprint) != KEY_BYTES:
            await r.reject(context, f"fingerprint is {len(fingerprint)} bytes; expected 32 raw bytes")
        namespace = await r.namespace(context)
        arena = self._arena_for(request, namespace)
        keys = list(zip(keys, scoped_keys(namespace, keys), strict=True))
        await r.permits.acquire(context)
        watch = ProgressDeadline.of_task(r.config.stream_idle_s, "the client read nothing")
        try:
            await self._stream_blobs(keys, fingerprint, context, watch, arena)
        except asyncio.CancelledError:
            if watch.stalled:
                r.count_stalled(context, watch)
            else:
                r.count_cancelled("Get")
            raise  # the call is cancelled (RST_STREAM): nothing waits behind the unread data
        finally:
            watch.close()
            r.permits.release()

    async def _stream_blobs(self, keys: list[tuple[bytes, bytes]], fingerprint: bytes,
                            context: grpc.aio.ServicerContext, watch: ProgressDeadline,
                            arena: ArenaTier | None) -> None:
        """Read the next batch from the store while the current one is sent: at most two batches
        of about `stream_buffer_bytes` each are held per stream. `keys`: (as the client sent it,
        as the store keeps it in the call's namespace). A write waits while the client
        is not reading (HTTP/2 flow control); the watch ends the stream when that lasts. With
        `arena`, pages go as refs into it (no copy), those held below loaded into it first."""
        r = self.requests
        ahead = GetBatches(keys, r.config.stream_buffer_bytes, lambda batch, sizer: asyncio.ensure_future(
            r.run(r.io, self._read_batch, batch, fingerprint, sizer, arena)))
        pending = ahead.next()
        try:
            while pending is not None:
                messages, handed, reused = await pending
                r.counters.shm_pages += handed
                r.counters.shm_pages_reused += reused
                pending = ahead.next()
                for message in messages:
                    await context.write(message)
                    watch.progress()
        finally:
            ahead.cancel(pending)

    def _read_batch(self, chunk: list[tuple[bytes, bytes]], fingerprint: bytes, sizer: BatchSizer,
                    arena: ArenaTier | None) -> tuple[list[bytes], int, int]:
        """The Get messages of one batch (on the io pool: reads and framing off the loop), with
        how many pages went as refs into the arena and how many of those were there already."""
        stored = [kept for _, kept in chunk]
        if arena is None:
            refs: list[Ref | None] = [None] * len(chunk)
            blobs, reused = self.store.get(stored), 0
        else:
            refs, blobs, reused = self.store.arena_refs(stored)
        messages = []
        for (key, kept), ref, blob in zip(chunk, refs, blobs, strict=True):
            if ref is not None:
                if fingerprint and not arena.matches(ref, lambda blob: _fingerprint_ok(blob, fingerprint)):
                    continue
                sizer.see(ref[1])
                messages.append(page_ref_message(key, *ref))
            elif (blob := as_sent(key, kept, blob, fingerprint)) is not None:
                sizer.see(len(blob))
                messages.append(page_blob_message(key, blob))
        return messages, sum(ref is not None for ref in refs), reused


def as_sent(key: bytes, kept: bytes, blob: bytes | None, fingerprint: bytes) -> bytes | None:
    """The blob the store holds under `kept` as a Get sends it for `key` (the key the client asked
    for: a namespace's page is rekeyed), or None when there is none or it is of another model
    than `fingerprint` (b"": any). Every Get, gRPC or bulk (server/bulk_gets.py), sends through here."""
    if blob is None or (fingerprint and not _fingerprint_ok(blob, fingerprint)):
        return None
    return rekeyed(blob, key) if key != kept else blob


def _fingerprint_ok(blob: bytes, fingerprint: bytes) -> bool:
    try:
        check_fingerprint(read_header(blob, check_crc=False), fingerprint)
    except BlobError:
        return False
    return True
