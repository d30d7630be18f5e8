"""`StoreShard`: a Ray actor running one store server (RAM in front of disk, optional Redis below).

It binds its node's IP (`host: auto`) on a free port (after a restart, the port it had, where
free), serves in-process on the server's own event
loop thread, and registers its address with the cluster directory, which workers watch to build
their ring. Each shard keeps its pages in `<disk_path>/<name>`: a shard restarted under the same
name on the same node finds its pages again (the disk tier's folder lock keeps a second process out).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import ray
from ray.experimental import internal_kv

from tiered_cache.client.stats import server_stats
from tiered_cache.metrics.families import server_families, tier_families
from tiered_cache.server.config import LOOPBACK, ServerConfig
from tiered_cache.server.store_server import StoreServer
from tiered_cache.wire.auth import token_from
from tiered_cache.workers.config import AUTO_HOST, ShardSettings
from tiered_cache.workers.directory import SHARD
from tiered_cache.workers.kv_events import member_endpoints
from tiered_cache.workers.names import DIRECTORY
from tiered_cache.workers.ray_metrics import RayMetrics

log = logging.getLogger("tiered_cache.workers.shard")


class StoreShard:
    def __init__(self, name: str, settings: ShardSettings, kv_events: str | None = None, slot: int = 0) -> None:
        self.name = name
        self.settings = settings
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        host = self.node_ip if settings.host == AUTO_HOST else settings.host
        token = token_from(settings.token, dict(os.environ))
        disk = str(Path(settings.disk_path).expanduser() / name) if settings.disk_path else None
        events = member_endpoints(kv_events, slot, self.node_ip) if kv_events else (None, None, False)
        self.config = ServerConfig(host=host, port=settings.port, token=token, tls_cert=settings.tls_cert,
                                   tls_key=settings.tls_key, ram_capacity=settings.ram_capacity, disk_path=disk,
                                   disk_capacity=settings.disk_capacity, redis_url=settings.redis_url,
                                   kv_events=events[0], kv_events_replay=events[1])
        if host not in LOOPBACK and not token:
            log.warning("shard %s listens on %s without a token: keep this network private or set shard.token",
                        name, host)
        port = self._start(name, settings.port)
        bracketed = f"[{host}]" if ":" in host else host
        self.address = f"{bracketed}:{port}"
        ray.get(ray.get_actor(DIRECTORY).register.remote(SHARD, name, self.address, self.node_id))
        self.metrics = RayMetrics(name, self._metric_families).start()

    def _start(self, name: str, port: int) -> int:
        """Start the server; with no port set, on the port this shard had before a restart where
        it is free, so clients that keep a fixed list of addresses (the vLLM connector's, set when
        its engine started) find it again; else on a free port. Returns the port."""
        key = f"tiered-cache:{ray.get_runtime_context().namespace}:{name}:port".encode()
        last = int(internal_kv._internal_kv_get(key) or 0) if not port else 0
        self.server = StoreServer(dataclasses.replace(self.config, port=port or last))
        try:
            bound = self.server.start()
        except Exception:
            if not last:
                raise
            log.warning("shard %s: its previous port %d is taken; on a free port now", name, last)
            self.server = StoreServer(self.config, store=self.server.store)
            bound = self.server.start()
        if not port:
            internal_kv._internal_kv_put(key, str(bound).encode(), overwrite=True)
        return bound

    def _metric_families(self) -> list[Any]:
        server = self.server
        return [*tier_families(server.store.stats()), *server_families(server.counters, server.service.permits.active)]

    def ping(self) -> str:
        return self.address

    def info(self) -> dict[str, Any]:
        return {"kind": SHARD, "name": self.name, "address": self.address, "node_id": self.node_id,
                "node_ip": self.node_ip, "pid": os.getpid(), "disk_path": self.config.disk_path,
                "events": self._events()}

    def _events(self) -> dict[str, str] | None:
        """This shard's KV event endpoints (what a router subscribes to), or None when off."""
        events = self.server.events
        if events is None:
            return None
        return {"endpoint": events.publisher.endpoint, "replay": events.publisher.replay_endpoint}

    def stats(self) -> dict[str, Any]:
        """The server's own figures (what `tiered-cache stats --address` prints for it), plus info."""
        token = self.config.token
        return {**self.info(), **server_stats(self.address, token, self.settings.tls_ca, 10.0)}

    def shutdown(self) -> int:
        """Leave the directory, drain streams and flush RAM to disk; returns pages flushed."""
        self.metrics.stop()
        with contextlib.suppress(ValueError, ray.exceptions.RayError):  # the directory is gone already
            ray.get(ray.get_actor(DIRECTORY).unregister.remote(self.name), timeout=5)
        return self.server.stop()
