"""What `tiered-cache serve` says at start: its tiers with their sizes and where they are, and
whether a Redis tier can be reached now (a URL's password is never printed)."""

from __future__ import annotations

from urllib.parse import urlsplit

from tiered_cache.model.units import format_binary
from tiered_cache.server.config import ServerConfig
from tiered_cache.tiers.base import Tier


def redis_where(url: str) -> str:
    """host:port/db of a Redis URL, without user or password."""
    parts = urlsplit(url)
    db = parts.path.strip("/") or "0"
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}/{db}"


def describe_tiers(config: ServerConfig, capacities: dict[str, int] | None = None) -> str:
    """The tiers as the server runs them: `capacities` (tier name -> bytes, from the running store)
    where the configured size could not be had (a disk with less room)."""
    real = capacities or {}
    tiers = [f"RAM {format_binary(real.get(Tier.RAM, config.ram_capacity))}"]
    if config.disk_path:
        disk = real.get(Tier.DISK, config.disk_capacity)
        asked = ("" if disk == config.disk_capacity
                 else f" (of {format_binary(config.disk_capacity)} asked: the room there)")
        tiers.append(f"disk {format_binary(disk)}{asked} at {config.disk_path}")
    if config.redis_url:
        tiers.append(f"Redis at {redis_where(config.redis_url)}")
    write = "write-through" if config.write_through else "written below on eviction and at shutdown"
    return " -> ".join(tiers) + (f" ({write})" if len(tiers) > 1 else "")


def redis_problem(url: str, timeout_s: float = 1.0) -> str | None:
    """None when the Redis at `url` answers a PING within `timeout_s`, else what is wrong."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        client.ping()
        return None
    except redis.RedisError as exc:
        reason = str(exc).split("\n")[0] or type(exc).__name__
        return f"Redis at {redis_where(url)} is not reachable now ({reason})"
    finally:
        client.close()


def memory_problem(ram_capacity: int) -> str | None:
    """What is wrong with a RAM tier larger than this machine's memory, or None."""
    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None
    if ram_capacity <= total:
        return None
    return (f"--ram {format_binary(ram_capacity)} is more than this machine's {format_binary(total)} of memory: "
            "the server would be killed for memory before its RAM tier fills")
