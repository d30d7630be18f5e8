"""The store server: `tiered_cache.v1.KVCache` (handlers.py) plus `grpc.health.v1`, on grpc.aio.

The server runs an asyncio event loop on its own thread; store work runs on thread pools (see
handlers.py). Streams are capped (`max_streams`, RESOURCE_EXHAUSTED past it) and each must make
progress within `stream_idle_s`, so a handful of idle or slow peers cannot stall everyone else.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tiered_cache.server.arena_tier import ArenaTier
from tiered_cache.server.bulk_gets import BulkGets
from tiered_cache.server.config import LOOPBACK, ServerConfig
from tiered_cache.server.handlers import KVCacheService
from tiered_cache.server.requests import ServerCounters, parse_put_item, parser
from tiered_cache.server.store import BlobStore
from tiered_cache.server.token_check import TokenInterceptor
from tiered_cache.shm.offers import OfferedSegments
from tiered_cache.tiers.base import Tier
from tiered_cache.tiers.factory import TierSettings, build_tiers
from tiered_cache.tiers.ram import RamTier
from tiered_cache.v1 import cache_pb2 as pb
from tiered_cache.wire.options import server_options

SERVICE = "tiered_cache.v1.KVCache"
_META_THREADS = 2  # Lookup and Stats: never queued behind data


def build_store(config: ServerConfig) -> BlobStore:
    """The server's RAM tier in front of its disk and/or Redis tiers (built by tiers/factory.py)."""
    kinds = [kind.value for kind, wanted in ((Tier.DISK, config.disk_path), (Tier.REDIS, config.redis_url)) if wanted]
    try:
        lower = build_tiers(kinds, TierSettings(disk_path=config.disk_path or "", disk_capacity=config.disk_capacity,
                                                redis_url=config.redis_url or "", redis_prefix=config.redis_prefix))
    except OSError as exc:
        if exc.filename is None or not config.disk_path:
            raise
        raise ValueError(f"--disk {config.disk_path}: cannot keep pages there ({exc.strerror or exc})") from None
    ram = (ArenaTier(config.ram_capacity, lease_s=config.arena_lease_s) if shared_memory(config)
           else RamTier(config.ram_capacity))
    return BlobStore(ram, lower, config.write_through)


def shared_memory(config: ServerConfig) -> bool:
    """Whether the server shares memory with same-host clients (Linux memfds)."""
    return config.shm and hasattr(os, "memfd_create")


class StoreServer:
    """A running store server. `start()` binds and returns the port; `stop()` drains and flushes.
    The gRPC server and its handlers live on an event loop in a thread of their own."""

    def __init__(self, config: ServerConfig, store: BlobStore | None = None) -> None:
        self.config = config
        self.store = store or build_store(config)
        self.counters = ServerCounters()
        self.port = 0
        self._io = ThreadPoolExecutor(config.workers, thread_name_prefix="tiered-cache-store-io")
        self._meta = ThreadPoolExecutor(_META_THREADS, thread_name_prefix="tiered-cache-store-meta")
        # Shared memory with same-host clients, both ways: the arena (the RAM tier) for Get, the
        # clients' own put rings (offered) for Put. `shm=False` turns both off.
        arena = self.store.ram if isinstance(self.store.ram, ArenaTier) else None
        self.service = KVCacheService(self.store, config, self.counters, self._io, self._meta, arena,
                                      OfferedSegments() if shared_memory(config) else None)
        self.bulk = BulkGets(config, self.store, self._io) if config.serves_bulk else None  # bulk_gets.py
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._health: Any = None
        self.metrics: Any = None  # a MetricsServer while running with config.metrics_port
        self.events: Any = None  # a CacheEvents while running with config.kv_events

    def start(self) -> int:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="tiered-cache-store-loop", daemon=True)
        self._thread.start()
        try:
            if self.bulk is not None:
                self.service.bulk_port = self.bulk.start()
            self.port = asyncio.run_coroutine_threadsafe(self._start(), loop).result()
        except BaseException:
            if self.bulk is not None:
                self.bulk.stop()
            self._stop_loop()
            raise
        try:
            if self.config.metrics_port is not None:
                self.metrics = self._serve_metrics()
            if self.config.kv_events is not None:
                self.events = self._publish_events()
        except BaseException:
            self.stop()
            raise
        return self.port

    def _publish_events(self) -> Any:
        """KV events of what this server stores (`ServerConfig.kv_events`), on the topic
        `store@HOST:PORT`, so a subscriber to several servers knows which one holds a page."""
        from tiered_cache.events.recorder import CacheEvents

        config = self.config
        events = CacheEvents.open(config.kv_events, 0, config.kv_events_replay, f"store@{config.host}:{self.port}",
                                  beyond_loopback=config.host not in LOOPBACK)
        self.store.watch_events(events)
        return events

    def _serve_metrics(self) -> Any:
        from tiered_cache.metrics import registry_of
        from tiered_cache.metrics.families import server_families, tier_families
        from tiered_cache.metrics.http import MetricsServer

        def build() -> list[Any]:
            service = self.service
            offered = service.offers.mapped_bytes() if service.offers is not None else 0
            return [*tier_families(self.store.stats()),
                    *server_families(self.counters, service.permits.active, self.counters.shm_pages,
                                     self.counters.shm_pages_reused, offered)]

        config = self.config
        return MetricsServer(registry_of(build), config.metrics_host, config.metrics_port or 0, config.metrics_token)

    async def _start(self) -> int:
        config = self.config
        interceptors = [TokenInterceptor(config.grants, self.counters)] if config.grants else []
        server = grpc.aio.server(interceptors=interceptors, options=server_options(config.max_message_bytes))
        server.add_generic_rpc_handlers([_handlers(self.service)])
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        host = config.host
        address = f"[{host}]:{config.port}" if ":" in host and not host.startswith("[") else f"{host}:{config.port}"
        if config.port:
            check_port_free(host, config.port)  # before gRPC tries: its own error is a log dump
        if config.tls_cert:
            creds = grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(),
                                                  Path(config.tls_cert).read_bytes())])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
        if not port:
            raise OSError(f"cannot listen on {address}")
        await server.start()
        self._server = server
        for name in ("", SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    def stop(self) -> int:
        """Stop taking calls, let in-flight streams finish (up to grace_s), flush RAM downward."""
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.bulk is not None:
            self.bulk.stop()
        if self._loop is not None and self._server is not None:
            asyncio.run_coroutine_threadsafe(self._drain(), self._loop).result()
        self._stop_loop()
        self._io.shutdown(wait=True)
        self._meta.shutdown(wait=True)
        offers, self.service.offers = self.service.offers, None
        if offers is not None:
            offers.close()
        flushed = self.store.flush()
        if self.events is not None:  # nothing is served from here now; a restarted server tells its disk again
            self.events.close()
            self.events = None
        return flushed

    async def _drain(self) -> None:
        await self._health.enter_graceful_shutdown()
        assert self._server is not None
        await self._server.stop(self.config.grace_s)

    def _stop_loop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join()
            self._loop.close()
            self._loop = None


def _handlers(service: KVCacheService) -> grpc.GenericRpcHandler:
    ser = lambda message: message.SerializeToString()  # noqa: E731
    raw = lambda message: message if isinstance(message, bytes) else message.SerializeToString()  # noqa: E731
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Lookup": grpc.unary_unary_rpc_method_handler(service.Lookup, parser(pb.LookupRequest), ser),
        # Get streams PageBlobs serialized by hand (framing.page_blob_message): one copy fewer.
        "Get": grpc.unary_stream_rpc_method_handler(service.Get, parser(pb.GetRequest), raw),
        "Put": grpc.stream_unary_rpc_method_handler(service.Put, parse_put_item, ser),
        "Stats": grpc.unary_unary_rpc_method_handler(service.Stats, parser(pb.StatsRequest), ser),
        "Attach": grpc.unary_unary_rpc_method_handler(service.Attach, parser(pb.AttachRequest), ser),
        "Offer": grpc.unary_unary_rpc_method_handler(service.Offer, parser(pb.OfferRequest), ser),
        "PutOffered": grpc.unary_unary_rpc_method_handler(service.PutOffered, parser(pb.PutOfferedRequest), ser),
    })


def check_port_free(host: str, port: int) -> None:
    """Raise OSError saying what to do when `host:port` cannot be bound (in use, not an address here)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server would: TIME_WAIT is no conflict
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(f"cannot listen on {host}:{port}: the port is in use (another server?); pick another "
                              f"--port, or --port 0 for a free one") from None
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
