"""What `tiered-cache serve` says at start: its tiers with their sizes and where they are, and
whether a Redis tier can be reached now (a URL's password is never printed)."""

from __future__ import annotations

from urllib.parse import urlsplit

from tiered_cache.model.units import format_binary
from tiered_cache.server.config import ServerConfig


def redis_where(url: str) -> str:
    """host:port/db of a Redis URL, without user or password."""
    parts = urlsplit(url)
    db = parts.path.strip("/") or "0"
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}/{db}"


def describe_tiers(config: ServerConfig) -> str:
    tiers = [f"RAM {format_binary(config.ram_capacity)}"]
    if config.disk_path:
        tiers.append(f"disk {format_binary(config.disk_capacity)} at {config.disk_path}")
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
