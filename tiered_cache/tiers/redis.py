"""Redis tier: page blobs in a real Redis (redis-py + hiredis), keys under a namespace prefix.

Redis bounds itself (`maxmemory` + an LRU `maxmemory-policy`, see deploy/redis.conf). Every call
has a socket timeout. When Redis is unreachable the tier answers misses at once, counts an
error, and retries after an exponential backoff; it never raises into the request path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from tiered_cache.tiers.base import TierStats, leading_run
from tiered_cache.tiers.codec import BlobError, verify_blob

T = TypeVar("T")
# A large read buffer: the default 32 KiB measured at half the throughput for MiB values.
SOCKET_READ_SIZE = 1 << 20


class RedisTier:
    name = "redis"
    thread_safe = True  # redis-py's connection pool serves every thread

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "tiered-cache",
                 ttl_s: float | None = None, timeout_s: float = 1.0, backoff_s: float = 0.05,
                 max_backoff_s: float = 5.0) -> None:
        import redis

        self._redis_errors = (redis.exceptions.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           socket_read_size=SOCKET_READ_SIZE)
        self.url = url
        self.prefix = prefix.encode() + b":"
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._delay = 0.0
        self._retry_at = 0.0
        self._stats = TierStats(self.name)

    def _k(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    @property
    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._retry_at

    def _call(self, fn: Callable[[], T], default: T) -> T:
        """Run `fn` unless backing off; on any Redis or socket error count it and back off."""
        if not self.available:
            return default
        try:
            result = fn()
        except self._redis_errors:
            self._stats.errors += 1
            self._delay = min(self.max_backoff_s, max(self.backoff_s, self._delay * 2))
            self._retry_at = time.monotonic() + self._delay
            return default
        self._delay = 0.0
        return result

    # --- interface -------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def exists() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._k(key))
            return [bool(found) for found in pipe.execute()]

        return self._call(exists, [False] * len(keys))

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return leading_run(self.contains(keys))

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        blobs = self._call(lambda: self.client.mget([self._k(k) for k in keys]), [None] * len(keys))
        out: list[bytes | None] = []
        corrupt = []
        for key, blob in zip(keys, blobs, strict=True):
            if blob is not None:
                try:
                    verify_blob(blob, key)
                except BlobError:
                    corrupt.append(key)
                    blob = None
            out.append(blob)
        self._stats.record_reads(out)
        if corrupt:
            self._stats.corrupt += len(corrupt)
            self.delete(corrupt)
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0

        def set_all() -> int:
            pipe = self.client.pipeline(transaction=False)
            for key, blob in items:
                pipe.set(self._k(key), blob, px=self.ttl_ms)
            pipe.execute()
            return len(items)

        stored = self._call(set_all, 0)
        self._stats.bytes_in += sum(len(b) for _, b in items) if stored else 0
        return stored

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call(lambda: self.client.delete(*[self._k(k) for k in keys]), 0)

    def stats(self) -> TierStats:
        info = self._call(lambda: self.client.info("memory"), None)
        if info is not None:
            self._stats.capacity_bytes = int(info.get("maxmemory", 0))
            self._stats.used_bytes = int(info.get("used_memory", 0))
            self._stats.pages = int(self._call(self.client.dbsize, self._stats.pages))
        return self._stats

    def close(self) -> None:
        self.client.close()
