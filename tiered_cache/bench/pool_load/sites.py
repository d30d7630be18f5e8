"""Where `bench pool-load` keeps the prefixes of one path while readers load them: nothing for host
RAM (each reader demotes its own prefixes there), a disk folder, a Redis, a store server on this
host. A `Site` tells a reader how to reach the tier (cache settings, the way a user configures
one) and gives the raw operation that moves a prefix's bytes out of it: the path's limit.

The limits: for host RAM and a same-host store server (its pages read in place in its arena), a
memcpy of the same bytes between touched buffers (on the CPU, the stand-in for a pinned host ->
device copy); for disk, reading each page file into its own row of a touched buffer (`os.readv`),
in order; for Redis, redis-py + hiredis MGETs of the same keys, as many keys a call as the tier
asks (`MGET_INTO_BYTES`), values kept.
"""

from __future__ import annotations

import enum
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_cache.bench.pool_load.prefixes import NAMESPACE, Prefix, Prefixes

PATHS = ("host", "tensor", "disk", "redis", "remote")


class Way(enum.Enum):
    """How a reader takes a prefix: the paged API into its pool, or the tensor API into a tensor."""

    LOAD = "match + load"
    PREFETCH = "match + prefetch + load"
    GET = "get()"
_MEMCPY = "memcpy (torch copy_), same bytes"


@dataclass
class Site:
    """One path's tier, filled with the run's prefixes `[0, count)` (host RAM: none)."""

    path: str  # one of PATHS
    label: str  # the row's name
    baseline_name: str
    settings: dict[str, Any]  # CacheConfig settings that put the tier below a reader's host RAM
    baseline: Callable[[Prefix], Callable[[], int]]  # the raw read of a prefix: returns bytes moved
    way: Way = Way.PREFETCH  # the headline's: the calls an engine makes
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def ways(self) -> tuple[Way, ...]:
        return ways_for(self.way)


def ways_for(way: Way) -> tuple[Way, ...]:
    """The ways timed for a site taking prefixes `way`: it first; into a pool by the engines' way,
    `match + load` (no prefetch) beside it."""
    return (way, Way.LOAD) if way is Way.PREFETCH else (way,)


def serving_prefixes(pool_prefixes: int, rounds: int) -> int:
    """Prefixes the serving rounds use (serving.py): the pool's fill, then each way's own prefixes
    every round (at most both ways of `ways_for(Way.PREFETCH)`); a reader's own come after them."""
    return pool_prefixes + len(ways_for(Way.PREFETCH)) * rounds


def memcpy_of(nbytes: int) -> Callable[[Prefix], Callable[[], int]]:
    """The memcpy baseline: `nbytes` between two buffers both touched before."""
    import torch

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    return lambda _prefix: lambda: dst.copy_(src).numel()


@contextmanager
def site(path: str, prefixes: Prefixes, count: int, folder: str | None = None,
         redis_url: str | None = None) -> Iterator[Site]:
    """The tier of `path` holding prefixes `[0, count)` (written by a cache of its own, then
    closed: readers never saw them), removed afterwards."""
    if path == "host":
        yield Site("host", "host RAM -> pool", _MEMCPY, {}, memcpy_of(prefixes.nbytes))
    elif path == "tensor":  # the tensor API (LMCache's way): the KV handed back in a tensor
        yield Site("tensor", "host RAM -> tensor (get())", _MEMCPY, {}, memcpy_of(prefixes.nbytes), Way.GET)
    elif path == "disk":
        with _disk_site(prefixes, count, folder) as made:
            yield made
    elif path == "redis":
        with _redis_site(prefixes, count, redis_url) as made:
            yield made
    elif path == "remote":
        with _remote_site(prefixes, count) as made:
            yield made
    else:
        raise ValueError(f"unknown path {path!r}; expected one of {', '.join(PATHS)}")


def put_prefixes(put: Callable[[list[tuple[bytes, bytes]]], int], prefixes: Prefixes, count: int, where: str) -> int:
    """Put the blobs of prefixes `[0, count)` with `put`, one prefix at a time; their total bytes."""
    total = 0
    for i in range(count):
        prefix = prefixes[i]
        blobs = prefix.blobs()
        if put(blobs) != len(blobs):
            raise RuntimeError(f"{where} stored only some of the {len(blobs)} pages of a prefix: is it large enough?")
        total += sum(len(b) for _, b in blobs)
        prefix.drop_pages()
    return total


@contextmanager
def _disk_site(prefixes: Prefixes, count: int, folder: str | None) -> Iterator[Site]:
    import numpy as np

    from tiered_cache.tiers.disk import DiskTier
    from tiered_cache.wire.codec import raw_blob_size

    blob = raw_blob_size(prefixes.spec)
    capacity = 2 * count * prefixes.num_pages * blob + 2**20
    with tempfile.TemporaryDirectory(prefix="tiered-cache-bench-pool-load-", dir=folder) as tmp:
        root = Path(tmp, "tier")
        writer = DiskTier(root, capacity, fsync=False)
        try:
            put_prefixes(writer.put, prefixes, count, "the disk tier")
            file_of = writer.file_of
        finally:
            writer.close()  # the folder has one owner: the reader opens it next
        rows = np.ones((prefixes.num_pages, blob), dtype=np.uint8)  # touched: a read writes into faulted-in memory

        def read_files(prefix: Prefix) -> Callable[[], int]:
            files = [file_of(k) for k in prefix.keys]

            def read() -> int:
                got = 0
                for row, file in zip(rows, files, strict=True):
                    fd = os.open(file, os.O_RDONLY)
                    try:
                        got += os.readv(fd, [row])
                    finally:
                        os.close(fd)
                return got
            return read

        settings = {"lower_tiers": "disk", "disk_path": str(root), "disk_capacity": capacity, "disk_fsync": False}
        yield Site("disk", "disk -> pool", "read each page file (os.readv into a touched row)",
                   settings, read_files)


@contextmanager
def _redis_site(prefixes: Prefixes, count: int, url: str | None) -> Iterator[Site]:
    import redis

    from tiered_cache.tiers.redis import MGET_INTO_BYTES, RedisTier
    from tiered_cache.tiers.redis_nodes import SOCKET_READ_SIZE
    from tiered_cache.wire.codec import raw_blob_size

    total = count * prefixes.num_pages * raw_blob_size(prefixes.spec)
    with _redis_at(url, total) as where:
        writer = RedisTier(where, prefix=NAMESPACE, timeout_s=30)
        raw = redis.Redis.from_url(where, socket_timeout=30, socket_connect_timeout=30,
                                   socket_read_size=SOCKET_READ_SIZE)  # the tier's own settings
        names: list[str] = []
        try:
            put_prefixes(writer.put, prefixes, count, f"Redis at {where}")
            names = [writer.name_of(k) for i in range(count) for k in prefixes[i].keys]
            step = max(1, MGET_INTO_BYTES // raw_blob_size(prefixes.spec))

            def mget(prefix: Prefix) -> Callable[[], int]:
                wanted = [writer.name_of(k) for k in prefix.keys]

                def read() -> int:
                    values: list[bytes | None] = []
                    for start in range(0, len(wanted), step):
                        values += raw.mget(wanted[start:start + step])
                    return sum(len(v) for v in values if v is not None)
                return read

            settings = {"lower_tiers": "redis", "redis_url": where, "redis_prefix": NAMESPACE, "redis_timeout_s": 30}
            yield Site("redis", "Redis -> pool", f"redis-py + hiredis MGET, {step} keys a call",
                       settings, mget)
        finally:
            for start in range(0, len(names), 1024):
                raw.delete(*names[start:start + 1024])
            raw.close()
            writer.close()


@contextmanager
def _remote_site(prefixes: Prefixes, count: int, shm: bool = True) -> Iterator[Site]:
    from tiered_cache.server.process import StoreProcess
    from tiered_cache.tiers.remote import RemoteTier
    from tiered_cache.wire.codec import raw_blob_size

    total = count * prefixes.num_pages * raw_blob_size(prefixes.spec)
    args = ["--no-disk", "--ram", f"{total * 5 // 4 // 2**20 + 64}MiB"] + ([] if shm else ["--shm", "off"])
    with StoreProcess(args) as store:
        writer = RemoteTier([store.address], timeout_s=30, fingerprint=bytes.fromhex(prefixes.spec.fingerprint))
        try:
            put_prefixes(writer.put, prefixes, count, f"the store server at {store.address}")
        finally:
            writer.close()
        settings = {"lower_tiers": "remote", "remote_addresses": store.address, "remote_timeout_s": 30}
        yield Site("remote", "same-host store server -> pool", _MEMCPY, settings,
                   memcpy_of(prefixes.nbytes))


@contextmanager
def _redis_at(url: str | None, total: int) -> Iterator[str]:
    """`url` when given (checked first), else a throwaway redis-server with room for `total` bytes."""
    if url is not None:
        from tiered_cache.server.startup import redis_problem

        problem = redis_problem(url)
        if problem:
            raise RuntimeError(f"{problem}: start it, or leave --url out to use a Redis started for the run")
        yield url
        return
    from tiered_cache.bench.redis_process import RedisServer

    with tempfile.TemporaryDirectory(prefix="tiered-cache-bench-pool-load-redis-") as folder:
        server = RedisServer(Path(folder), maxmemory=f"{max(256, 3 * total // 2 // 2**20)}mb")
        server.start()
        try:
            yield server.url
        finally:
            server.stop()
