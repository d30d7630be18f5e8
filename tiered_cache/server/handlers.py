"""The `tiered_cache.v1.KVCache` handlers, as asyncio coroutines over a `BlobStore`.

The event loop only parses, checks and moves messages; every store call (which may read disk or
Redis, and checksums blobs) runs on a thread pool: `io` for Get and Put data, a small `meta` pool
for Lookup and Stats, so a Lookup never queues behind another client's multi-GiB Get. A stream
that stalls is a parked coroutine, not a held thread, and is ended after `stream_idle_s`.

`KVCacheService` is the service gRPC calls: Lookup and Get are `GetHandlers`' (get_handlers.py),
Put, Offer and PutOffered are `PutHandlers`' (put_handlers.py); Attach and Stats are its own.
What they share (parsing, checks, counters, pools, the stream cap) is `Requests` (requests.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from typing import Any

import grpc

from tiered_cache import __version__
from tiered_cache.server.arena_tier import ArenaTier
from tiered_cache.server.config import ServerConfig
from tiered_cache.server.get_handlers import GetHandlers
from tiered_cache.server.put_handlers import PutHandlers
from tiered_cache.server.requests import Requests, ServerCounters
from tiered_cache.server.store import BlobStore
from tiered_cache.server.streams import StreamPermits
from tiered_cache.shm.host import host_identity
from tiered_cache.shm.offers import OfferedSegments
from tiered_cache.tiers.base import TierStats
from tiered_cache.v1 import cache_pb2 as pb

_NOT_IN_PROTO = {"hit_rate", "breakers"}  # derived, or per server (the counts travel instead)


class KVCacheService:
    def __init__(self, store: BlobStore, config: ServerConfig, counters: ServerCounters,
                 io: Executor, meta: Executor, arena: ArenaTier | None = None,
                 offers: OfferedSegments | None = None) -> None:
        self.store = store
        self.config = config
        self.counters = counters
        self.requests = Requests(config, counters, io, meta)
        self.arena = arena  # the RAM tier in shared memory, when on: same-host clients read it in place
        self.gets = GetHandlers(self.requests, store, arena)
        self.puts = PutHandlers(self.requests, store, offers)
        self.bulk_port = 0  # the bulk Get's listener (bulk_gets.py), told to clients by Attach; 0: none

    @property
    def permits(self) -> StreamPermits:
        """Get, Put and PutOffered calls in progress, at most `max_streams`."""
        return self.requests.permits

    @property
    def offers(self) -> OfferedSegments | None:
        """Clients' segments mapped for same-host Put, when on (`None` once the server stops)."""
        return self.puts.offers

    @offers.setter
    def offers(self, offers: OfferedSegments | None) -> None:
        self.puts.offers = offers

    # --- RPCs ----------------------------------------------------------------------------------
    async def Lookup(self, request: Any, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        return await self.gets.Lookup(request, context)

    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        await self.gets.Get(request, context)

    async def Put(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        return await self.puts.Put(request_iterator, context)

    async def Offer(self, request: Any, context: grpc.aio.ServicerContext) -> pb.OfferResponse:
        return await self.puts.Offer(request, context)

    async def PutOffered(self, request: Any, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        return await self.puts.PutOffered(request, context)

    async def Attach(self, request: Any, context: grpc.aio.ServicerContext) -> pb.AttachResponse:
        """Where a client on this host finds the arena (empty when shared memory is off, and for a
        call in a namespace other than the empty one: server/tenants.py)."""
        await self.requests.take_unary(request, context)
        arena, bulk_port = self.arena, self.bulk_port
        if await self.requests.namespace(context):  # shared memory shows every namespace: not offered
            return pb.AttachResponse(bulk_port=bulk_port)
        if arena is None:
            return pb.AttachResponse(host=host_identity() if self.offers is not None else "", bulk_port=bulk_port)
        return pb.AttachResponse(path=arena.path, size=arena.size, segment=arena.id, host=host_identity(),
                                 bulk_port=bulk_port)

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        await self.requests.take_unary(request, context)
        await self.requests.require_operator(context, "Stats")
        c = self.counters
        server = pb.ServerStats(version=__version__, uptime_s=time.monotonic() - c.started, requests=c.requests,
                                rejected_requests=c.rejected, unauthenticated=c.unauthenticated,
                                refused_blobs=c.refused_blobs, active_streams=self.permits.active,
                                refused_streams=self.permits.refused, stalled_streams=c.stalled_streams,
                                cancelled_streams=c.cancelled_streams,
                                shm_pages=c.shm_pages, shm_pages_reused=c.shm_pages_reused,
                                shm_put_pages=c.shm_put_pages,
                                shm_offers=len(self.offers) if self.offers is not None else 0,
                                shm_offered_bytes=self.offers.mapped_bytes() if self.offers is not None else 0)
        tiers = [pb.TierStats(**{k: v for k, v in s.to_dict().items() if k not in _NOT_IN_PROTO})
                 for s in await self._tiers_stats()]
        return pb.StatsResponse(tiers=tiers, server=server)

    async def _tiers_stats(self) -> list[TierStats]:
        """The tiers' figures, on the meta pool: no data lock is taken (tiers report counters), and
        a Redis tier asks INFO at most once a second by itself (tiers/redis.py)."""
        return await self.requests.run(self.requests.meta, self.store.stats)
