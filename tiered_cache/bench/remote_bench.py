"""`tiered-cache bench remote`: fetching a many-page prefix through `RemoteTier` beside a bare gRPC
stream of the same bytes and a raw Redis MGET of the same blobs, all in one run; and lookup
latency for a 32k-token prompt beside a bare gRPC unary call of the same request size."""

from __future__ import annotations

import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from tiered_cache.bench.timing import Comparison, best_time
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.service.client import StoreClient, channel_options
from tiered_cache.service.process import StoreProcess
from tiered_cache.tiers.codec import encode_page
from tiered_cache.tiers.remote import RemoteTier

GIB = 2**30


class _RawServer:
    def __enter__(self) -> str:
        self.proc = subprocess.Popen([sys.executable, "-m", "tiered_cache.bench.raw_grpc"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        found = re.search(r"listening on (\S+)", line)
        if not found:
            raise RuntimeError(f"raw gRPC server did not start: {line!r}")
        return found.group(1)

    def __exit__(self, *exc: object) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


def _blobs(spec: KVSpec, num_pages: int, ns: str = "bench") -> list[tuple[bytes, bytes]]:
    keys = PageKeyer(spec, ns).keys(list(range(num_pages * spec.page_size)))
    page = torch.randn(spec.staging_shape(1)[1:], generator=torch.Generator().manual_seed(0)).to(spec.dtype.torch)
    return [(k, encode_page(page, spec, k)) for k in keys]


def bench_fetch(spec: KVSpec, num_pages: int) -> list[Comparison]:
    items = _blobs(spec, num_pages)
    keys = [k for k, _ in items]
    size = len(items[0][1])
    total = size * num_pages
    scale = f"{num_pages} × {size / 2**20:.2f} MiB"
    with StoreProcess(["--no-disk", "--ram", f"{2 * total // 2**20 + 64}MiB"]) as store, _RawServer() as raw_addr:
        StoreClient(store.address, timeout_s=120).put(items)
        tier = RemoteTier([store.address], timeout_s=120)
        assert all(b is not None for b in tier.get(keys)), "the store lost pages during the benchmark"
        ours = best_time(lambda: tier.get(keys), repeat=3)

        channel = grpc.insecure_channel(raw_addr, options=channel_options(80 * 2**20))
        stream = channel.unary_stream("/raw.Raw/Stream")
        request = struct.pack("<QQ", num_pages, size)
        kept = best_time(lambda: list(stream(request, timeout=120)), repeat=3)  # kept, as a get must

        def drain() -> None:
            for _ in stream(request, timeout=120):
                pass

        dropped = best_time(drain, repeat=3)  # each message dropped on arrival: the transport ceiling
        rows = [Comparison(scale, "remote get (verified)", total / ours / GIB, "bare gRPC stream, kept",
                           total / kept / GIB, "GiB/s", True),
                Comparison(scale, "remote get (verified)", total / ours / GIB, "bare gRPC stream, dropped",
                           total / dropped / GIB, "GiB/s", True)]
        rows.append(_redis_row(items, total, scale, ours))
        channel.close()
        tier.close()
    return rows


def _redis_row(items: list[tuple[bytes, bytes]], total: int, scale: str, ours: float) -> Comparison:
    import redis

    from tiered_cache.tiers.redis import SOCKET_READ_SIZE
    from tiered_cache.tiers.redis_process import RedisServer

    server = RedisServer(Path(tempfile.mkdtemp()), maxmemory=f"{2 * total // 2**20 + 64}mb")
    server.start()
    try:
        client = redis.Redis.from_url(server.url, socket_timeout=120, socket_read_size=SOCKET_READ_SIZE)
        names = [k.hex().encode() for k, _ in items]
        pipe = client.pipeline(transaction=False)
        for name, (_, blob) in zip(names, items, strict=True):
            pipe.set(name, blob)
        pipe.execute()
        mget = best_time(lambda: client.mget(names), repeat=3)
        client.close()
    finally:
        server.stop()
    return Comparison(scale, "remote get (verified)", total / ours / GIB, "raw Redis MGET", total / mget / GIB,
                      "GiB/s", True)


def bench_lookup(num_tokens: int = 32768, page_size: int = 16, repeat: int = 30) -> list[Comparison]:
    spec = KVSpec("lookup-bench", 1, 1, 8, page_size=page_size)
    items = _blobs(spec, num_tokens // page_size, "lookup")
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store, _RawServer() as raw_addr:
        StoreClient(store.address, timeout_s=60).put(items)
        tier = RemoteTier([store.address])
        assert tier.contains_prefix(keys) == len(keys)
        channel = grpc.insecure_channel(raw_addr, options=channel_options(80 * 2**20))
        echo = channel.unary_unary("/raw.Raw/Echo")
        request = b"".join(keys)
        ours, raw = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            tier.contains_prefix(keys)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            echo(request, timeout=10)
            raw.append(time.perf_counter() - start)
        channel.close()
        tier.close()
    label = f"{num_tokens:,} tokens ({len(keys):,} keys)"
    return [Comparison(label, "remote lookup, median", statistics.median(ours) * 1e3,
                       "bare gRPC unary, same bytes", statistics.median(raw) * 1e3, "ms", False)]
