"""`tiered-cache bench remote`: getting a many-page prefix through `RemoteTier` beside a bare gRPC
stream of the same bytes and a raw Redis MGET of the same blobs, all in one run; and lookup
latency for a 32k-token prompt beside a bare gRPC unary call of the same request size.

`bench_clients`: N client processes getting one prefix at once (aggregate GiB/s) while another
process times Lookups, beside N bare gRPC streams. `bench_long_prefix`: a prefix of GiBs through
`RemoteTier` with its default deadlines, whole and verified, beside one bare gRPC stream."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiered_cache.bench.remote_clients import (
    GetClient,
    LookupClient,
    MappedBlobs,
    RawStreamClient,
    Report,
    raw_channel,
    raw_stream_request,
    run_together,
    verify_pages,
)
from tiered_cache.bench.timing import Comparison, best_time, returned_bytes, timed
from tiered_cache.client.store_client import StoreClient
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.codec import encode_page, page_view

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


def _lookup_items(num_tokens: int, page_size: int = 16) -> list[tuple[bytes, bytes]]:
    """A prompt's page blobs, tiny (one layer, one head): what a Lookup is asked about."""
    return _blobs(KVSpec("lookup-bench", 1, 1, 8, page_size=page_size), num_tokens // page_size, "lookup")


def _store_args(total: int) -> list[str]:
    """A RAM-only store server with room for `total` bytes of blobs and their overhead."""
    return ["--no-disk", "--ram", f"{2 * total // 2**20 + 64}MiB"]


def bench_get(spec: KVSpec, num_pages: int) -> list[Comparison]:
    items = _blobs(spec, num_pages)
    keys = [k for k, _ in items]
    size = len(items[0][1])
    total = size * num_pages
    scale = f"{num_pages} × {size / 2**20:.2f} MiB"
    with StoreProcess(_store_args(total)) as store, _RawServer() as raw_addr:
        StoreClient(store.address, timeout_s=120).put(items)
        tier = RemoteTier([store.address], timeout_s=120, shm=False)  # bytes over gRPC, as from another host
        assert all(b is not None for b in tier.get(keys)), "the store lost pages during the benchmark"
        ours, got = timed(lambda: tier.get(keys), repeat=3)
        rows = _same_host_rows(store.address, keys, spec, total, scale)

        channel = raw_channel(raw_addr)
        stream = channel.unary_stream("/raw.Raw/Stream")
        request = raw_stream_request(num_pages, size)
        kept, messages = timed(lambda: list(stream(request, timeout=120)), repeat=3)  # kept, as a get must

        def drain() -> int:
            return sum(len(m) for m in stream(request, timeout=120))  # each counted, then dropped

        dropped, drained = timed(drain, repeat=3)  # each message dropped on arrival: the transport ceiling
        work = returned_bytes(got)
        rows += [Comparison(scale, "remote get as bytes (verified)", total / ours / GIB, "bare gRPC stream, kept",
                            total / kept / GIB, "GiB/s", True, work, returned_bytes(messages)),
                 Comparison(scale, "remote get as bytes (verified)", total / ours / GIB, "bare gRPC stream, dropped",
                            total / dropped / GIB, "GiB/s", True, work, drained)]
        rows.append(_redis_row(items, total, scale, ours, work))
        channel.close()
        tier.close()
    return rows


def _same_host_rows(address: str, keys: list[bytes], spec: KVSpec, total: int, scale: str) -> list[Comparison]:
    """The same pages read by a client on the server's host, in place in its arena (the server
    copies nothing), beside a memcpy of the same bytes: the limit of any way of getting them into
    this process. Two ways: `get_into` touched page rows, as a cache loads them (one pass copies
    and checks each page), and `get`, a new `bytes` object per page (fresh memory every call)."""
    import numpy as np

    from tiered_cache.bench.gpu_rows import copy_limit

    tier = RemoteTier([address], timeout_s=120)
    try:
        tier.warm()  # maps the arena
        got = tier.get(keys)
        assert all(b is not None for b in got) and tier.servers[0].client.uses_shm, "no same-host arena read"
        rows = np.ones((len(keys), spec.bytes_per_page), dtype=np.uint8)  # touched, as a pool's pages are
        into, sizes = timed(lambda: tier.get_into(keys, list(rows), spec), repeat=3)
        assert all(sizes), "the store lost pages during the benchmark"
        blobs = dict(zip(keys, got, strict=True))  # the pages as `get` gave them above
        assert all(np.array_equal(row, page_view(blobs[k], spec, k)) for k, row in zip(keys, rows, strict=True)), \
            "get_into wrote other bytes than the pages'"
        ours, got = timed(lambda: tier.get(keys), repeat=3)
    finally:
        tier.close()
    _, memcpy = copy_limit(total, "cpu")
    limit = total / memcpy / GIB
    return [Comparison(scale, "remote get_into pages, same host (arena, verified)", total / into / GIB,
                       "memcpy of the same bytes", limit, "GiB/s", True, sum(sizes), total),
            Comparison(scale, "remote get as bytes, same host (arena, verified)", total / ours / GIB,
                       "memcpy of the same bytes", limit, "GiB/s", True, returned_bytes(got), total)]


def bench_put(spec: KVSpec, num_pages: int, repeat: int = 3) -> list[Comparison]:
    """Putting a prefix into a store server on this host: through the client's own shared-memory
    ring (the default here) beside the same pages streamed as bytes (a client with `shm=False`)
    and a bare gRPC client stream of the same bytes into a server that keeps none of them.
    Each timed put stores fresh pages (another namespace), as write-behind does."""
    import struct

    batches = [_blobs(spec, num_pages, f"put-{i}") for i in range(2 * repeat)]
    size = len(batches[0][0][1])
    total = size * num_pages
    scale = f"{num_pages} × {size / 2**20:.2f} MiB"
    store_bytes = 2 * repeat * total
    with StoreProcess(_store_args(store_bytes)) as store, _RawServer() as raw_addr:
        ring, plain = StoreClient(store.address, timeout_s=120), StoreClient(store.address, timeout_s=120, shm=False)
        fresh = iter(batches)

        def put(client: StoreClient) -> int:
            reply = client.put(next(fresh))
            return reply.stored * size  # pages stored, in bytes: what this put really did

        ours, stored = timed(lambda: put(ring), repeat=repeat)
        assert ring.uses_shm_put, "the store server did not take this client's ring"
        streamed, stored_plain = timed(lambda: put(plain), repeat=repeat)
        channel = raw_channel(raw_addr)
        absorb = channel.stream_unary("/raw.Raw/Absorb")
        blobs = [b for _, b in batches[0]]
        bare, absorbed = timed(lambda: struct.unpack("<Q", absorb(iter(blobs), timeout=120))[0], repeat=repeat)
        channel.close()
        ring.close()
        plain.close()
    name = "remote put, same host (client's ring)"
    return [Comparison(scale, name, total / ours / GIB, "remote put as bytes (gRPC stream)", total / streamed / GIB,
                       "GiB/s", True, stored, stored_plain),
            Comparison(scale, name, total / ours / GIB, "bare gRPC client stream", total / bare / GIB,
                       "GiB/s", True, stored, absorbed)]


def _redis_row(items: list[tuple[bytes, bytes]], total: int, scale: str, ours: float, work: int) -> Comparison:
    import redis

    from tiered_cache.bench.redis_process import RedisServer
    from tiered_cache.tiers.redis_nodes import SOCKET_READ_SIZE

    with tempfile.TemporaryDirectory(prefix="tiered-cache-bench-redis-") as folder:
        server = RedisServer(Path(folder), maxmemory=f"{2 * total // 2**20 + 64}mb")
        server.start()
        try:
            client = redis.Redis.from_url(server.url, socket_timeout=120, socket_read_size=SOCKET_READ_SIZE)
            names = [k.hex().encode() for k, _ in items]
            pipe = client.pipeline(transaction=False)
            for name, (_, blob) in zip(names, items, strict=True):
                pipe.set(name, blob)
            pipe.execute()
            mget, values = timed(lambda: client.mget(names), repeat=3)
            client.close()
        finally:
            server.stop()
    return Comparison(scale, "remote get as bytes (verified)", total / ours / GIB, "raw Redis MGET", total / mget / GIB,
                      "GiB/s", True, work, returned_bytes(values))


def bench_lookup(num_tokens: int = 32768, page_size: int = 16, repeat: int = 30) -> list[Comparison]:
    items = _lookup_items(num_tokens, page_size)
    keys = [k for k, _ in items]
    with StoreProcess(["--no-disk"]) as store, _RawServer() as raw_addr:
        StoreClient(store.address, timeout_s=60).put(items)
        tier = RemoteTier([store.address])
        assert tier.contains_prefix(keys) == len(keys)
        channel = raw_channel(raw_addr)
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


def bench_clients(spec: KVSpec, num_pages: int, counts: list[int], duration_s: float = 5.0,
                  lookup_tokens: int = 32768) -> list[Comparison]:
    """For each N in `counts`: N client processes get the same prefix through their own
    `RemoteTier` for `duration_s` (every page verified) while one more times Lookups of a
    `lookup_tokens`-token prompt; then N bare gRPC streams of the same bytes for as long. One client
    is always measured first: N clients' aggregate is also shown against it."""
    assert all(n > 0 for n in counts) and duration_s > 0
    counts = sorted(set(counts) | {1})
    items, prompt = _blobs(spec, num_pages), _lookup_items(lookup_tokens)
    keys, size = [k for k, _ in items], len(items[0][1])
    with tempfile.TemporaryDirectory() as tmp, StoreProcess(_store_args(size * num_pages)) as store, \
            _RawServer() as raw_addr:
        expected = MappedBlobs.write(Path(tmp) / "blobs", [b for _, b in items])
        StoreClient(store.address, timeout_s=120).put(items + prompt)
        del items
        lookup = (LookupClient, (store.address, [k for k, _ in prompt], "lookup client"))
        print(f"timing lookups of {len(prompt):,} keys with the store idle for {duration_s:g} s ...", file=sys.stderr)
        idle = run_together([lookup], duration_s)[0].latencies
        rows: list[Comparison] = []
        one_client = 0.0
        for n in counts:
            print(f"{n} client processes getting {num_pages} pages for {duration_s:g} s, then {n} bare gRPC "
                  "streams ...", file=sys.stderr)
            getters = [(GetClient, (store.address, keys, expected, f"get client {i}")) for i in range(n)]
            *got, looked = run_together(getters + [lookup], duration_s)
            raw = run_together([(RawStreamClient, (raw_addr, num_pages, size, f"raw client {i}"))
                                for i in range(n)], duration_s)
            ours, ceiling = _aggregate(got), _aggregate(raw)
            one_client = one_client or ours
            scale = f"{n} client{'s' if n > 1 else ''}, {num_pages} × {size / 2**20:.2f} MiB"
            rows.append(Comparison(scale, "remote get, aggregate (verified)", ours,
                                   f"bare gRPC stream × {n}, kept", ceiling, "GiB/s", True))
            for q in (50, 99):
                rows.append(Comparison(scale, f"lookup p{q}, {len(prompt):,} keys, during the gets",
                                       _percentile(looked.latencies, q) * 1e3, f"lookup p{q}, store idle",
                                       _percentile(idle, q) * 1e3, "ms", False))
            if n > 1:
                rows.append(Comparison(scale, "remote get, aggregate (verified)", ours, "remote get, 1 client",
                                       one_client, "GiB/s", True))
    return rows


def _aggregate(reports: list[Report]) -> float:
    """GiB/s of all clients together: every byte of their calls over the window from the first
    release to the last call's end (calls still running past the deadline lengthen the window)."""
    window = max(r.ended for r in reports) - min(r.started for r in reports)
    return sum(r.nbytes for r in reports) / window / GIB


def _percentile(values: tuple[float, ...], q: int) -> float:
    assert values, "no call was timed"
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def bench_long_prefix(spec: KVSpec, gib: float, repeat: int = 2) -> list[Comparison]:
    """A prefix of `gib` GiB put into a store server and got through `RemoteTier` with its
    default settings (5 s progress deadline, no budget), every page verified, best of `repeat`;
    beside one bare gRPC stream of the same bytes, kept. Raises when a page is missing or wrong."""
    num_pages = max(1, round(gib * GIB / spec.bytes_per_page))
    print(f"encoding {num_pages:,} pages ({num_pages * spec.bytes_per_page / GIB:.2f} GiB) ...", file=sys.stderr)
    items = _blobs(spec, num_pages)
    keys, expected = [k for k, _ in items], [b for _, b in items]
    size = len(expected[0])
    total = size * num_pages
    with StoreProcess(_store_args(total)) as store, _RawServer() as raw_addr:
        print(f"putting {total / GIB:.2f} GiB into a store server ...", file=sys.stderr)
        StoreClient(store.address).put(items)
        del items
        tier = RemoteTier([store.address])  # defaults: the progress deadline is what lets GiBs through
        ours = float("inf")
        for run in range(repeat):
            print(f"getting {total / GIB:.2f} GiB through the remote tier ({run + 1}/{repeat}) ...", file=sys.stderr)
            start = time.perf_counter()
            blobs = tier.get(keys)
            ours = min(ours, time.perf_counter() - start)
            verify_pages(blobs, expected, "long prefix")
            del blobs
        tier.close()
        channel = raw_channel(raw_addr)
        stream = channel.unary_stream("/raw.Raw/Stream")
        request = raw_stream_request(num_pages, size)
        kept = best_time(lambda: list(stream(request, timeout=600)), repeat=repeat)
        channel.close()
    scale = f"{total / GIB:.2f} GiB, {num_pages:,} × {size / 2**20:.2f} MiB"
    return [Comparison(scale, f"remote get, defaults ({num_pages:,}/{num_pages:,} pages whole, verified)",
                       total / ours / GIB, "bare gRPC stream, kept", total / kept / GIB, "GiB/s", True)]
