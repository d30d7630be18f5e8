"""Where `tiered-cache bench gpu` keeps a prompt's prefix, one place per row, and how each row's
cache is put back into the same state before every measurement.

- `device`, `host`: one cache that computed the prefix; `host` evicts its device pages to host
  RAM before each measurement (the pages already there are only freed).
- `disk`, `store`, `store-noshm`, `redis`: a writer cache puts the prefix into the tier
  (write-through, flushed, closed); a reader cache, kept for all rounds as a running engine keeps
  its channels, staging buffers and shared-memory mapping, then finds it only there. Before each
  measurement the reader drops what the last one loaded (device pages evicted, host RAM
  cleared) and forgets what it learnt the tier holds, so it asks the tier again, as an instance
  that never saw this prefix does.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiered_cache.bench.gpu_rows import synchronize
from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import KVSpec

# The tier each row's pages must come from (the names in GenerationResult.sources).
TIER_OF = {"device": "device", "host": "host", "disk": "disk", "store": "remote", "store-noshm": "remote",
           "redis": "redis"}


def cache_config(device: str, pool_bytes: int, host_bytes: int) -> CacheConfig:
    """A bench cache's settings. The watermark at 1.0: the background demoter never moves pages
    while a row is measured (a pool this full would otherwise start it during the load)."""
    settings: dict[str, Any] = dict(device=device, pool_capacity=pool_bytes, host_capacity=host_bytes,
                                    high_watermark=1.0, low_watermark=0.95)
    if "reuse" in CacheConfig.__dataclass_fields__:
        settings["reuse"] = "always"  # the bench measures every tier, also one slower than recompute
    return CacheConfig(**settings)


@dataclass
class Servers:
    """The store servers (with and without the shared-memory arena) and Redis, started once for
    the whole run and sized for all its prefixes together; `folder` holds the disk rows' folders."""

    folder: Path
    store: str | None = None
    store_noshm: str | None = None
    redis_url: str | None = None
    disk_bytes: int = 2**30
    _stack: ExitStack = field(default_factory=ExitStack)

    @classmethod
    def start(cls, rows: tuple[str, ...], kv_bytes: int) -> Servers:
        """Start what `rows` need; the store keeps `kv_bytes` and more in RAM (its arena, which
        same-host instances read in place)."""
        from tiered_cache.server.process import StoreProcess

        stack = ExitStack()
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tiered-cache-bench-gpu-")))
        servers = cls(folder, disk_bytes=2 * kv_bytes + 64 * 2**20, _stack=stack)
        ram = f"{kv_bytes * 5 // 4 + 64 * 2**20}B"
        try:
            if "store" in rows:
                servers.store = stack.enter_context(StoreProcess(
                    ["--no-disk", "--ram", ram])).address
            if "store-noshm" in rows:
                servers.store_noshm = stack.enter_context(StoreProcess(
                    ["--no-disk", "--ram", ram, "--shm", "off"])).address
            if "redis" in rows:
                from tiered_cache.bench.redis_process import RedisServer

                redis = RedisServer(folder, maxmemory=f"{(kv_bytes * 5 // 4) // 2**20 + 64}mb")
                redis.start()
                stack.callback(redis.stop)
                servers.redis_url = redis.url
        except BaseException:
            stack.close()
            raise
        return servers

    def lower_settings(self, row: str, tokens: int) -> dict[str, Any]:
        """The CacheConfig fields that put `row`'s tier below host RAM."""
        if row == "disk":
            # No fsync: the row measures the tier's read path (the files lie in the OS page cache,
            # just written), and 4 GiB of fsync'd writes would take most of the bench's time.
            return {"lower_tiers": ["disk"], "disk_path": str(self.folder / f"disk-{tokens}"),
                    "disk_capacity": self.disk_bytes, "disk_fsync": False}
        if row == "redis":
            return {"lower_tiers": ["redis"], "redis_url": self.redis_url, "redis_timeout_s": 30.0}
        address = self.store if row == "store" else self.store_noshm
        return {"lower_tiers": ["remote"], "remote_addresses": [address], "remote_timeout_s": 30.0}

    def close(self) -> None:
        self._stack.close()


def fill_tier(spec: KVSpec, settings: CacheConfig, tokens: list[int], kv: torch.Tensor) -> None:
    """Put the KV of `tokens` into the tiers `settings` names below host RAM, through a writer
    cache (write-through, flushed and closed before this returns)."""
    with TieredCache(spec, settings.replace(write_policy="write_through")) as writer:
        writer.put(tokens, kv)
        writer.flush()
    del writer
    gc.collect()  # its pool and pinned buffers go back to torch's allocators for the next cache


class LowerSource:
    """The prefix only in `row`'s tier below host RAM (`fill_tier` put it there), read by one
    reader cache."""

    def __init__(self, row: str, spec: KVSpec, settings: CacheConfig) -> None:
        self.row = row
        self.cache = TieredCache(spec, settings)
        self.cache.warming.join()  # its channels open now: a running engine has them open

    def reset(self) -> None:
        """Drop the prefix from the reader's device pool and host RAM, and what it knows the tier
        holds."""
        cache = self.cache
        cache.flush()
        cache.evict()
        cache.host.delete(list(cache.host.index))
        for index in range(len(cache.chain.tiers)):
            cache.chain.forget(index)

    def close(self) -> None:
        self.cache.close()
        folder = self.cache.config.disk_path
        del self.cache
        gc.collect()  # the pool and pinned buffers go back to torch's allocators now
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


class UpperSource:
    """The prefix in the device pool (`device`) or only in host RAM (`host`) of the cache that
    computed it."""

    def __init__(self, row: str, cache: TieredCache) -> None:
        self.row = row
        self.cache = cache
        self.evictions: list[tuple[int, float]] = []  # (bytes, seconds) of each `host` reset's demotion

    def reset(self) -> None:
        """`host`: the prefix's copies in host RAM dropped, then its device pages demoted there
        (`evict`), timed: the demotion path device -> host RAM, every page copied."""
        self.cache.flush()
        if self.row == "host":
            self.cache.host.delete(list(self.cache.host.index))
            synchronize(self.cache.pool.device)
            started = time.perf_counter()
            moved = self.cache.evict()
            synchronize(self.cache.pool.device)
            self.evictions.append((moved * self.cache.spec.bytes_per_page, time.perf_counter() - started))
