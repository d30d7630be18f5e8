"""`tiered-cache bench engine`: request-path latency when every request forces demotion.

Each request stores a fresh prompt of `pages` pages (`TieredCache.put`, what a prefill does)
into a pool that is already full, so room is made by demoting that many cold pages device ->
host RAM, and host RAM in turn drops as many toward the tiers below. The same requests run with
nothing below host RAM (the baseline), with a real Redis below, and with a real store server
below, in one run. The request path must not pay for the tiers below: encoding and network puts
belong to the write-behind queue, so the p99 with a lower tier should stay near the baseline's.

Between requests the host CPU idles for `gap_ms`, as it does while a GPU runs a prefill (the
background threads work then); `gap_ms=0` measures a saturated host instead. Redis and the
store server share the requests' host and its cores, which a deployment would not.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.device.pool import usable_device
from tiered_cache.model.presets import preset_spec


@dataclass(frozen=True)
class EngineRow:
    below: str  # what is under host RAM
    requests: int
    pages_per_request: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    dropped: int  # pages not written below: the write-behind was full
    baseline_p99_ms: float

    @property
    def p99_ratio(self) -> float:
        return self.p99_ms / self.baseline_p99_ms

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "p99_vs_host_only": self.p99_ratio}


def _requests(spec: Any, count: int, pages: int, device: str = "cpu") -> list[tuple[list[int], torch.Tensor]]:
    n = pages * spec.page_size
    gen = torch.Generator().manual_seed(0)
    # One tensor on the pool's device, as a prefill leaves it: content is not timed.
    kv = torch.randn(spec.kv_shape(n), generator=gen).to(spec.dtype.torch).to(device)
    return [(list(range(i * n, (i + 1) * n)), kv) for i in range(count)]


def _latencies(cache: TieredCache, requests: list[tuple[list[int], torch.Tensor]], warmup: int,
               gap_s: float) -> list[float]:
    """Time each request's cache call, idling `gap_s` between requests."""
    times = []
    for i, (tokens, kv) in enumerate(requests):
        start = time.perf_counter()
        cache.put(tokens, kv)
        if kv.is_cuda:
            torch.cuda.synchronize()  # the request's copies are done, as the next forward needs
        if i >= warmup:
            times.append(time.perf_counter() - start)
        time.sleep(gap_s)
    return times


def _lower_tier(name: str, redis: Any, store: Any) -> dict[str, Any]:
    """The CacheConfig settings that put configuration `name`'s tier under host RAM."""
    if name == "redis":
        return {"lower_tiers": ["redis"], "redis_url": redis.url, "redis_prefix": "bench-engine"}
    if name == "remote":
        return {"lower_tiers": ["remote"], "remote_addresses": [store.address]}
    return {}


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_engine(model: str = "smollm2-135m", pages: int = 32, requests: int = 120, gap_ms: float = 20.0,
                 below: tuple[str, ...] = ("host only", "redis", "remote"), device: str = "cpu",
                 rounds: int = 1) -> list[EngineRow]:
    """With `rounds` > 1 the configurations take turns (host only, then each lower tier, again
    and again), each turn `requests` requests on a fresh cache, so a slow spell of a shared
    machine falls on all of them; the figures are over every turn's counted requests."""
    from tiered_cache.bench.redis_process import RedisServer
    from tiered_cache.server.process import StoreProcess

    spec = preset_spec(model, page_size=16)
    if below[0] != "host only" or not set(below) <= {"host only", "redis", "remote"}:
        raise ValueError(f"below must start with 'host only' (the baseline) and name only redis and remote, "
                         f"got {', '.join(below)}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    reqs = _requests(spec, requests, pages, str(usable_device(device)))  # a missing GPU: one clear error
    warmup = max(4, requests // 10)
    # The pool and host RAM hold two requests' pages each; default watermarks.
    base = {"pool_capacity": 2 * pages * spec.bytes_per_page, "host_capacity": 2 * pages * spec.bytes_per_page,
            "malloc_tuning": True, "device": device}
    times: dict[str, list[float]] = {name: [] for name in below}
    dropped = dict.fromkeys(below, 0)
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp), maxmemory="1gb") if "redis" in below else None
        if redis is not None:
            redis.start()
        store = StoreProcess(["--no-disk", "--ram", "2GiB"]) if "remote" in below else None
        try:
            if store is not None:
                store.start()
            configs = {name: CacheConfig(**base, **_lower_tier(name, redis, store)) for name in below}
            for round_ in range(1, rounds + 1):
                for name, config in configs.items():
                    turn = f" (round {round_}/{rounds})" if rounds > 1 else ""
                    print(f"{name}{turn}: {requests} requests of {pages} pages, each demoting as many, "
                          f"{gap_ms:g} ms idle between requests ...", file=sys.stderr, flush=True)
                    cache = TieredCache(spec, config)
                    times[name] += _latencies(cache, reqs, warmup, gap_ms / 1e3)
                    dropped[name] += cache.stats().dropped_pages
                    cache.close()
        finally:
            if store is not None:
                store.stop()
            if redis is not None:
                redis.stop()
    baseline = _p(times[below[0]], 0.99) * 1e3
    rows = []
    for name, t in times.items():
        rows.append(EngineRow(name, len(t), pages, statistics.median(t) * 1e3, _p(t, 0.99) * 1e3, max(t) * 1e3,
                              dropped[name], baseline))
    return rows


def render(rows: list[EngineRow]) -> str:
    from tiered_cache.report.table import render_table

    table = [[r.below, f"{r.requests}", f"{r.pages_per_request}", f"{r.p50_ms:,.2f} ms", f"{r.p99_ms:,.2f} ms",
              f"{r.max_ms:,.2f} ms", f"{r.dropped}", f"{r.p99_ratio:.2f}x"] for r in rows]
    return render_table(table, ["below host RAM", "requests", "pages demoted each", "p50", "p99", "max",
                                "pages not written below", "p99 vs host only"], align_right=(1, 2, 3, 4, 5, 6, 7))
