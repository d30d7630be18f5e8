"""`tiered-cache bench promote`: a prefix loaded into the device pool through `TieredCache`
(`match` + `load`) from host RAM, disk, Redis and a store server, each beside the raw operation
that moves the same bytes out of that tier, measured in the same run; and the demotion of the
pool into host RAM (`evict`) beside memcpy.

Every round starts from the same state (the prefix only in the tier measured) and times the
baseline and the load in turn, alternating which goes first; each figure is the median of the
rounds after a warm-up round (connections, rings, the page cache). Disk figures are with the
page cache warm for both sides. The baselines:
- host RAM, demotion: a memcpy of the same bytes (torch `copy_`, both buffers touched before):
  on the CPU, the stand-in for "a pinned host -> device copy" on a GPU;
- disk: reading each page file into its own row of a touched buffer (`os.readv`), in order;
- Redis: redis-py + hiredis MGETs of the same keys, as many keys a call as the tier asks
  (`MGET_INTO_BYTES`; one MGET of every key ran at about half that speed here), values kept;
- a store server on this host (its pages read in place in its arena): a memcpy of the same
  bytes, as for host RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from tiered_cache.cache import TieredCache
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.tiers.base import BlobTier

PATHS = ("host", "disk", "redis", "remote")
_NAMESPACE = "bench-promote"


@dataclass(frozen=True)
class PromoteRow:
    """One path into (or out of) the pool beside its raw baseline, medians of `rounds` rounds."""

    path: str
    seconds: float
    baseline_name: str
    baseline_seconds: float
    nbytes: int  # KV bytes of the prefix
    work: int  # bytes the last timed run really moved (pages loaded or demoted x page bytes)
    baseline_work: int  # bytes the baseline's last call really returned
    rounds: int

    @property
    def gbs(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def baseline_gbs(self) -> float:
        return self.nbytes / self.baseline_seconds / 1e9

    @property
    def ratio(self) -> float:
        """Speed relative to the baseline: 1 is as fast as the raw operation."""
        return self.baseline_seconds / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gb_per_s": self.gbs, "baseline_gb_per_s": self.baseline_gbs, "ratio": self.ratio}


class Prefix:
    """A prefix of about `mib` MiB of KV: its tokens, page keys and pages (page-first)."""

    def __init__(self, spec: KVSpec, mib: float) -> None:
        import torch

        from tiered_cache.index.keys import PageKeyer

        self.spec = spec
        self.num_pages = max(1, int(mib * 2**20) // spec.bytes_per_page)
        self.tokens = list(range(self.num_pages * spec.page_size))
        self.keys = PageKeyer(spec, _NAMESPACE).keys(self.tokens)
        generator = torch.Generator().manual_seed(0)
        self.pages = torch.randn(spec.staging_shape(self.num_pages), generator=generator).to(spec.dtype.torch)
        self.nbytes = self.num_pages * spec.bytes_per_page

    def kv(self) -> torch.Tensor:
        """The prefix's KV in the tensor API's shape (layers, 2, tokens, heads, dim)."""
        order = (1, 2, 0, *range(3, self.pages.dim()))  # (pages, L, 2, *inner) -> (L, 2, pages, *inner)
        whole = self.pages.permute(order)
        if self.spec.page_inner_shape[0] != self.spec.page_size:  # HND pages: (heads, page, dim)
            whole = whole.transpose(3, 4)
        return whole.reshape(self.spec.kv_shape(len(self.tokens)))

    def blobs(self) -> list[tuple[bytes, bytes]]:
        from tiered_cache.wire.codec import encode_page

        return [(k, encode_page(p, self.spec, k)) for k, p in zip(self.keys, self.pages, strict=True)]


def bench_promote(spec: KVSpec, mib: float = 256, rounds: int = 7, paths: tuple[str, ...] = PATHS,
                  folder: str | None = None, redis_url: str | None = None,
                  progress: Callable[[str], None] | None = None) -> list[PromoteRow]:
    """The rows of `paths` (of PATHS) for a prefix of `mib` MiB; `folder` holds the disk tier's
    files (default: a temporary folder), `redis_url` an existing Redis (default: one started
    for the run)."""
    from tiered_cache.device.malloc import tune_malloc

    tune_malloc()  # as TieredCache and the commands do: the baselines get the same heap
    say = progress or (lambda _: None)
    prefix = Prefix(spec, mib)
    rows: list[PromoteRow] = []
    if "host" in paths:
        say(f"host RAM <-> pool: {prefix.num_pages} pages of {spec.bytes_per_page:,} bytes, {rounds} rounds ...")
        rows += _host_rows(prefix, rounds)
    if "disk" in paths:
        say("disk -> pool ...")
        rows.append(_disk_row(prefix, rounds, folder))
    if "redis" in paths:
        say("Redis -> pool ...")
        rows.append(_redis_row(prefix, rounds, redis_url))
    if "remote" in paths:
        say("store server -> pool ...")
        rows.append(_remote_row(prefix, rounds))
    return rows


# --- the paths ----------------------------------------------------------------------------------------
def _host_rows(prefix: Prefix, rounds: int) -> list[PromoteRow]:
    """Each round: the pool demoted into host RAM (`evict`, timed), then loaded back (timed),
    then host RAM's copies dropped, so the next round demotes again."""
    import torch

    cache = _cache(prefix, [])
    src = torch.ones(prefix.nbytes, dtype=torch.uint8)
    dst = torch.zeros(prefix.nbytes, dtype=torch.uint8)
    try:
        cache.put(prefix.tokens, prefix.kv())
        demote, load, memcpy = [], [], []
        moved, pages = 0, None
        for r in range(rounds + 1):  # round 0 warms up
            _drop_host_copies(cache, prefix)
            seconds, moved = _clock(cache.evict)
            seconds_load, pages = _clock(lambda: _load(cache, prefix))
            seconds_copy, _ = _clock(lambda: dst.copy_(src))
            if r:
                demote.append(seconds)
                load.append(seconds_load)
                memcpy.append(seconds_copy)
        assert pages is not None
        _check_pool(cache, pages, prefix)
        base = statistics.median(memcpy)
        name = "memcpy (torch copy_), same bytes"
        page = prefix.spec.bytes_per_page
        return [PromoteRow("host RAM -> pool (match + load)", statistics.median(load), name, base, prefix.nbytes,
                           len(pages) * page, dst.numel(), rounds),
                PromoteRow("pool -> host RAM (evict)", statistics.median(demote), name, base, prefix.nbytes,
                           moved * page, dst.numel(), rounds)]
    finally:
        cache.close()


def _disk_row(prefix: Prefix, rounds: int, folder: str | None) -> PromoteRow:
    import numpy as np

    from tiered_cache.tiers.disk import DiskTier

    blobs = prefix.blobs()
    with tempfile.TemporaryDirectory(prefix="tiered-cache-bench-promote-", dir=folder) as tmp:
        tier = DiskTier(Path(tmp, "tier"), 2 * sum(len(b) for _, b in blobs) + 2**20, fsync=False)
        tier.put(blobs)
        files = [tier.file_of(k) for k in prefix.keys]
        rows = np.ones((len(files), len(blobs[0][1])), dtype=np.uint8)  # touched: a read writes into faulted-in memory

        def read_files() -> int:
            got = 0
            for row, file in zip(rows, files, strict=True):
                fd = os.open(file, os.O_RDONLY)
                try:
                    got += os.readv(fd, [row])
                finally:
                    os.close(fd)
            return got

        return _lower_row(prefix, tier, rounds, "disk -> pool (match + load)",
                          "read each page file (os.readv into a touched row)", read_files)


def _redis_row(prefix: Prefix, rounds: int, url: str | None) -> PromoteRow:
    import redis

    from tiered_cache.tiers.redis import MGET_INTO_BYTES, RedisTier
    from tiered_cache.tiers.redis_nodes import SOCKET_READ_SIZE
    from tiered_cache.wire.codec import raw_blob_size

    blobs = prefix.blobs()
    with _redis_at(url, sum(len(b) for _, b in blobs)) as where:
        tier = RedisTier(where, prefix="bench-promote", timeout_s=30)
        if tier.put(blobs) != len(blobs):
            raise RuntimeError(f"Redis at {where} stored only some of the {len(blobs)} pages: is its maxmemory "
                               "large enough?")
        raw = redis.Redis.from_url(where, socket_timeout=30, socket_connect_timeout=30,
                                   socket_read_size=SOCKET_READ_SIZE)  # the tier's own settings
        names = [tier.name_of(k) for k in prefix.keys]
        step = max(1, MGET_INTO_BYTES // raw_blob_size(prefix.spec))

        def mget() -> int:
            values: list[bytes | None] = []
            for start in range(0, len(names), step):
                values += raw.mget(names[start:start + step])
            return sum(len(v) for v in values if v is not None)

        try:
            return _lower_row(prefix, tier, rounds, "Redis -> pool (match + load)",
                              f"redis-py + hiredis MGET, {step} keys a call", mget)
        finally:
            raw.delete(*names)
            raw.close()


def _remote_row(prefix: Prefix, rounds: int) -> PromoteRow:
    import torch

    from tiered_cache.server.process import StoreProcess
    from tiered_cache.tiers.remote import RemoteTier

    blobs = prefix.blobs()
    total = sum(len(b) for _, b in blobs)
    with StoreProcess(["--no-disk", "--ram", f"{2 * total // 2**20 + 64}MiB"]) as store:
        tier = RemoteTier([store.address], timeout_s=30, fingerprint=bytes.fromhex(prefix.spec.fingerprint))
        tier.warm()
        if tier.put(blobs) != len(blobs):
            raise RuntimeError(f"the store server at {store.address} stored only some of the {len(blobs)} pages")
        src, dst = torch.ones(prefix.nbytes, dtype=torch.uint8), torch.zeros(prefix.nbytes, dtype=torch.uint8)
        dst.copy_(src)  # both touched
        return _lower_row(prefix, tier, rounds, "same-host store server -> pool (match + prefetch + load)",
                          "memcpy (torch copy_), same bytes", lambda: dst.copy_(src).numel(), prefetch=True)


def _lower_row(prefix: Prefix, tier: BlobTier, rounds: int, path: str, baseline_name: str,
               baseline: Callable[[], int], prefetch: bool = False) -> PromoteRow:
    """The prefix loaded from `tier` (alone below host RAM) beside `baseline`, alternating which
    runs first; before each load, the pool and host RAM are emptied of it."""
    cache = _cache(prefix, [tier])
    try:
        ours: list[float] = []
        base: list[float] = []
        pages, got = None, 0
        for r in range(rounds + 1):  # round 0 warms up
            _only_below(cache, prefix)
            if r % 2:  # the load first in odd rounds, the baseline first in even ones
                seconds, pages = _clock(lambda: _load(cache, prefix, prefetch))
                seconds_base, got = _clock(baseline)
            else:
                seconds_base, got = _clock(baseline)
                seconds, pages = _clock(lambda: _load(cache, prefix, prefetch))
            if r:
                ours.append(seconds)
                base.append(seconds_base)
        assert pages is not None
        _check_pool(cache, pages, prefix)
        return PromoteRow(path, statistics.median(ours), baseline_name, statistics.median(base), prefix.nbytes,
                          len(pages) * prefix.spec.bytes_per_page, got, rounds)
    finally:
        cache.close()  # closes the tier too


# --- helpers ------------------------------------------------------------------------------------------
def _cache(prefix: Prefix, lower: list[BlobTier]) -> TieredCache:
    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig

    room = prefix.nbytes + 16 * prefix.spec.bytes_per_page
    # No background demotion (high watermark 1.0): the pool holds the whole prefix, and nothing
    # may move it between the timed steps.
    config = CacheConfig(pool_capacity=room, host_capacity=room, namespace=_NAMESPACE, high_watermark=1.0,
                         low_watermark=0.5)
    cache = TieredCache(prefix.spec, config, lower=lower)
    for memory in (cache.pool.pretouch, cache.host.pretouch):
        if memory is not None:
            memory.join()  # faulted in before timing, as a long-running engine's would be
    return cache


def _load(cache: TieredCache, prefix: Prefix, prefetch: bool = False) -> np.ndarray:
    handle = cache.match(prefix.tokens)
    try:
        if prefetch:
            cache.prefetch(handle)
        return cache.load(handle)
    finally:
        cache.release(handle)


def _drop_host_copies(cache: TieredCache, prefix: Prefix) -> None:
    """Forget the prefix's pages in host RAM. No public call does this; host RAM's index is
    guarded by the cache's lock, so it is taken here."""
    with cache._lock:
        cache.host.delete(prefix.keys)


def _only_below(cache: TieredCache, prefix: Prefix) -> None:
    """The prefix out of the pool and host RAM: only the tier below holds it."""
    cache.evict()
    cache.flush()
    _drop_host_copies(cache, prefix)


def _check_pool(cache: TieredCache, pages: np.ndarray, prefix: Prefix) -> None:
    """The loaded pages hold the prefix's bytes exactly (else the figures are of a broken load)."""
    import torch

    if len(pages) != prefix.num_pages or not torch.equal(cache.pool.gather(pages), prefix.pages):
        raise AssertionError(f"the load gave {len(pages)} of {prefix.num_pages} pages, or wrong bytes")


def _clock(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


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

    with tempfile.TemporaryDirectory(prefix="tiered-cache-bench-promote-redis-") as folder:
        server = RedisServer(Path(folder), maxmemory=f"{max(256, 3 * total // 2**20)}mb")
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


# --- the command ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=float, default=256, help="MiB of KV in the prefix (default 256)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds, the median kept (default 7)")
    parser.add_argument("--model", default="llama-3.1-8b", help="preset whose KV is moved")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16: 2 MiB pages)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"which of {','.join(PATHS)} (default all)")
    parser.add_argument("--dir", help="folder for the disk tier's files (default: a temporary folder)")
    parser.add_argument("--url", help="an existing Redis (default: start a throwaway redis-server)")


def run_promote_bench(args: argparse.Namespace) -> int:
    from tiered_cache.model.presets import get_preset

    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    unknown = sorted(set(paths) - set(PATHS))
    if unknown or not paths:
        raise SystemExit(f"tiered-cache bench promote: --paths takes some of {','.join(PATHS)}, got {args.paths!r}")
    if not args.mib > 0 or args.rounds <= 0:
        raise SystemExit("tiered-cache bench promote: --mib and --rounds must be positive")
    spec = get_preset(args.model).spec.with_options(page_size=args.page_size)
    rows = bench_promote(spec, args.mib, args.rounds, paths, args.dir, args.url,
                         progress=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print(f"host: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
              f"{rows[0].nbytes / 2**20:,.0f} MiB of {spec.dtype.value} KV ({args.model}, {spec.bytes_per_page:,}-byte "
              f"pages); median of {args.rounds} rounds, each from the same state; disk: page cache warm for both")
        print(render(rows))
    return 0


def render(rows: list[PromoteRow]) -> str:
    from tiered_cache.report.table import render_table

    table = [[r.path, f"{r.seconds * 1e3:,.1f} ms", f"{r.gbs:,.2f} GB/s", r.baseline_name,
              f"{r.baseline_seconds * 1e3:,.1f} ms", f"{r.baseline_gbs:,.2f} GB/s", f"{r.ratio:.2f}x"] for r in rows]
    return render_table(table, ["path", "time", "rate", "baseline", "baseline time", "baseline rate",
                                "vs baseline"], align_right=(1, 2, 4, 5, 6))
