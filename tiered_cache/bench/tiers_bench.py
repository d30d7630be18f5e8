"""`tiered-cache bench host|disk|redis`: each tier's put/get throughput beside the raw operation
on the same bytes, measured in the same run (memcpy; file write + fsync; redis-py SET/MGET)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from tiered_cache.bench.timing import Comparison, returned_bytes, timed
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.wire.codec import encode_page

GIB = 2**30


def _data(spec: KVSpec, num_pages: int, seed: int = 0) -> tuple[list[bytes], torch.Tensor]:
    keys = PageKeyer(spec, f"bench-{seed}").keys(list(range(num_pages * spec.page_size)))
    pages = torch.randn(spec.staging_shape(num_pages), generator=torch.Generator().manual_seed(seed))
    return keys, pages.to(spec.dtype.torch)


def _rate(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / GIB


def bench_host(spec: KVSpec, num_pages: int) -> list[Comparison]:
    from tiered_cache.tiers.host import HostTier

    keys, pages = _data(spec, num_pages)
    total = num_pages * spec.bytes_per_page
    host = HostTier(spec, total)
    out = torch.empty_like(pages)
    src, dst = pages.reshape(-1).clone(), torch.empty(pages.numel(), dtype=pages.dtype)
    memcpy_s, copied = timed(lambda: dst.copy_(src))
    memcpy = _rate(total, memcpy_s)

    put_s, stored = float("inf"), 0
    for _ in range(5):
        host.delete(keys)
        seconds, stored = timed(lambda: host.put(keys, pages), repeat=1)
        put_s = min(put_s, seconds)
    get_s, (found, _) = timed(lambda: host.get(keys, out=out))
    assert host.get(keys, out=out)[0] == num_pages and torch.equal(out, pages)
    scale = f"{num_pages} × {spec.bytes_per_page / 2**20:.2f} MiB"
    moved = returned_bytes(copied)
    return [Comparison(scale, "host put", _rate(total, put_s), "memcpy (torch copy_)", memcpy, "GiB/s", True,
                       stored * spec.bytes_per_page, moved),
            Comparison(scale, "host get", _rate(total, get_s), "memcpy (torch copy_)", memcpy, "GiB/s", True,
                       found * spec.bytes_per_page, moved)]


def bench_disk(spec: KVSpec, num_pages: int, folder: str | None = None) -> list[Comparison]:
    from tiered_cache.tiers.disk import DiskTier

    keys, pages = _data(spec, num_pages)
    blobs = [encode_page(p, spec, k) for k, p in zip(keys, pages, strict=True)]
    total = sum(len(b) for b in blobs)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        raw_dir, tier_dir = Path(tmp, "raw"), Path(tmp, "tier")
        raw_dir.mkdir()

        def raw_write() -> int:
            written = 0
            for i, blob in enumerate(blobs):
                fd = os.open(raw_dir / f"{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                written += os.write(fd, blob)
                os.fsync(fd)
                os.close(fd)
            return written

        def raw_read() -> list[bytes]:  # kept, as a get must return them all
            return [(raw_dir / f"{i}").read_bytes() for i in range(len(blobs))]

        tier = DiskTier(tier_dir, total * 2)

        def tier_write() -> int:
            tier.delete(keys)
            tier.put(list(zip(keys, blobs, strict=True)))
            return tier.stats().used_bytes

        def tier_read() -> int:
            return returned_bytes(tier.get(keys))

        results = [("disk put (atomic + fsync)", tier_write, "write + fsync per file", raw_write),
                   ("disk get (verified)", tier_read, "read_bytes per file", lambda: returned_bytes(raw_read()))]
        scale = f"{num_pages} × {len(blobs[0]) / 2**20:.2f} MiB"
        rows = []
        for name, ours, base_name, base in results:
            base_s, base_work = timed(base, repeat=3)
            ours_s, work = timed(ours, repeat=3)
            rows.append(Comparison(scale, name, _rate(total, ours_s), base_name, _rate(total, base_s),
                                   "GiB/s", True, work, base_work))
        return rows


def bench_redis(spec: KVSpec, num_pages: int, url: str | None = None) -> list[Comparison]:
    import redis

    from tiered_cache.bench.redis_process import RedisServer
    from tiered_cache.tiers.redis import RedisTier
    from tiered_cache.tiers.redis_nodes import SOCKET_READ_SIZE

    keys, pages = _data(spec, num_pages)
    blobs = [encode_page(p, spec, k) for k, p in zip(keys, pages, strict=True)]
    total = sum(len(b) for b in blobs)
    server, folder = None, None
    if url is None:
        folder = tempfile.TemporaryDirectory(prefix="tiered-cache-bench-redis-")
        server = RedisServer(Path(folder.name), maxmemory=f"{max(256, 4 * total // 2**20)}mb")
        server.start()
        url = server.url
    else:
        from tiered_cache.server.startup import redis_problem

        problem = redis_problem(url)
        if problem:
            raise RuntimeError(f"{problem}: start it, or leave --url out to use a Redis started for the run")
    try:
        tier = RedisTier(url, prefix="bench-tier", timeout_s=30)
        raw = redis.Redis.from_url(url, socket_timeout=30, socket_read_size=SOCKET_READ_SIZE)
        raw_names = [b"bench-raw:" + k.hex().encode() for k in keys]

        def raw_set() -> int:
            pipe = raw.pipeline(transaction=False)
            for name, blob in zip(raw_names, blobs, strict=True):
                pipe.set(name, blob)
            return sum(len(b) for b, ok in zip(blobs, pipe.execute(), strict=True) if ok)

        items = list(zip(keys, blobs, strict=True))
        raw_set()
        tier.put(items)
        scale = f"{num_pages} × {len(blobs[0]) / 2**20:.2f} MiB"
        (set_s, set_work), (put_s, _) = (timed(f, repeat=3) for f in (raw_set, lambda: tier.put(items)))
        put_work = sum(len(b) for b, held in zip(blobs, tier.contains(keys), strict=True) if held)
        (mget_s, mget_work), (get_s, get_work) = (
            timed(f, repeat=3) for f in (lambda: returned_bytes(raw.mget(raw_names)),
                                         lambda: returned_bytes(tier.get(keys))))
        assert all(b is not None for b in tier.get(keys)), "the Redis tier lost pages during the benchmark"
        return [Comparison(scale, "redis put", _rate(total, put_s), "redis-py pipelined SET", _rate(total, set_s),
                           "GiB/s", True, put_work, set_work),
                Comparison(scale, "redis get (verified)", _rate(total, get_s), "redis-py MGET", _rate(total, mget_s),
                           "GiB/s", True, get_work, mget_work)]
    finally:
        if server is not None:
            server.stop()
        if folder is not None:
            folder.cleanup()
