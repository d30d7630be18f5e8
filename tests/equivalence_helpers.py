"""Caches in each tier, for checking that a cache hit changes nothing but the time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import KVSpec


def cache_with_prefix_in(tier: str, spec: KVSpec, tmp: Path, store_address: str | None = None,
                         codec: str = "raw") -> TieredCache:
    """A cache whose pages, once cached and then pushed down, will be found in `tier` and loaded:
    reuse="always", since these tests check that a hit changes nothing but the time, and a tiny
    model recomputes a few pages about as fast as a store sends them (whether a hit pays is the
    reuse policy's call, tested in test_reuse.py)."""
    if tier == "remote":
        cfg = CacheConfig(pool_capacity="32MiB", host_capacity="32MiB", lower_tiers=["remote"],
                          remote_addresses=[store_address], write_policy="write_through", codec=codec,
                          reuse="always")
    elif tier == "disk":
        cfg = CacheConfig(pool_capacity="32MiB", host_capacity="32MiB", lower_tiers=["disk"],
                          disk_path=str(tmp / "disk"), write_policy="write_through", codec=codec, reuse="always")
    else:
        cfg = CacheConfig(pool_capacity="32MiB", host_capacity="32MiB", codec=codec, reuse="always")
    return TieredCache(spec, cfg)


def push_down(cache: TieredCache, tier: str) -> None:
    """Leave the cached pages only in `tier` (device, host, disk) before the next request."""
    if tier == "device":
        return
    cache.flush()  # write-through copies run in the background
    cache.evict()
    if tier in ("disk", "remote"):
        cache.host.delete(list(cache.host.index))


def fresh_instance(tier: str, spec: KVSpec, tmp: Path, store_address: str | None, codec: str = "raw") -> Any:
    """For the remote tier, the reader is another cache (as instance B would be)."""
    return cache_with_prefix_in(tier, spec, tmp, store_address, codec)
