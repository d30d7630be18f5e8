"""`bench pool-load`'s headline: prefixes loaded the way serving loads them. A reader cache whose
pool holds `pool_prefixes` prefixes is filled first (for the tiers below, by loading prefixes
from the tier; for host RAM, by the tensor API), so the pool is full and stays full: every load
pushes it past the high watermark and the background demoter makes room for the next. Each round
then loads a prefix this reader has never read (every checksum verified) beside the path's
limit, alternating which goes first, in each of the site's ways: `match` + `prefetch` + `load`,
the calls our engines make (the connector, `integrations/transformers.py`, the workers), and
`match` + `load` beside it (their order alternating too); between loads the demotions a load
started finish (the gap between a request's prefill and the next one's). Each figure is the
median of the rounds.

Index layout of a run's prefixes per path: `[0, pool_prefixes)` fill the pool, the next `rounds`
per way are timed, and the ones after that go to a reader process started for the bench
(first.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiered_cache.bench.pool_load.prefixes import NAMESPACE, Prefix, Prefixes
from tiered_cache.bench.pool_load.sites import Site, Way

if TYPE_CHECKING:
    from tiered_cache.cache import TieredCache

_SETTLE_S = 30.0  # at most this long for a round's demotions to finish before the next round


@dataclass(frozen=True)
class Timed:
    """A load beside its limit: medians of `rounds` rounds."""

    seconds: float
    baseline_seconds: float
    work: int  # bytes the last timed load really placed (pages x page bytes)
    baseline_work: int  # bytes the baseline's last call really returned
    rounds: int

    @property
    def ratio(self) -> float:
        """Speed relative to the limit: 1 is as fast as the raw operation."""
        return self.baseline_seconds / self.seconds


def reader(prefixes: Prefixes, settings: dict[str, Any], pool_prefixes: int, host_prefixes: int) -> TieredCache:
    """A reader cache on `settings` (its tiers below), its pool holding `pool_prefixes` prefixes
    and its host RAM `host_prefixes`, memory faulted in before it returns."""
    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig

    page = prefixes.spec.bytes_per_page
    config = CacheConfig(namespace=NAMESPACE, pool_capacity=reader_pool_pages(prefixes, pool_prefixes) * page,
                         host_capacity=host_prefixes * prefixes.nbytes + 4 * page, **settings)
    return TieredCache(prefixes.spec, config)


def reader_pool_pages(prefixes: Prefixes, pool_prefixes: int) -> int:
    """The pages of a `reader`'s pool holding `pool_prefixes` prefixes (and a few spare)."""
    return pool_prefixes * prefixes.num_pages + 4


def serving_rounds(site: Site, prefixes: Prefixes, rounds: int, pool_prefixes: int) -> dict[Way, Timed]:
    """The timed rounds of `site`, per way (see the module doc)."""
    fill = range(pool_prefixes)
    first = pool_prefixes
    # Interleaved, so each way meets prefixes stored as early and as late as the other's (a tier may
    # treat older pages differently: a store's arena holds the latest).
    ways = len(site.ways)
    by_way = {w: [prefixes[first + r * ways + i] for r in range(rounds)] for i, w in enumerate(site.ways)}
    timed = [p for ps in by_way.values() for p in ps]
    host = site.path in ("host", "tensor")
    # Host RAM holds the timed prefixes and what the pool demotes; below it, a pool's worth.
    cache = reader(prefixes, site.settings, pool_prefixes, len(timed) + pool_prefixes + 2 if host else pool_prefixes)
    try:
        cache.warming.join()  # faulted in before timing, as a long-running engine's would be
        if host:  # the timed prefixes into host RAM (written, then demoted), then the pool filled
            for prefix in timed:
                cache.put(prefix.tokens, prefix.kv())
                cache.evict()
            for i in fill:
                cache.put(prefixes[i].tokens, prefixes[i].kv())
                prefixes[i].drop_pages()
        else:
            for i in fill:
                got = load(cache, prefixes[i])
                if len(got) != prefixes.num_pages:
                    raise RuntimeError(f"{site.label}: filling the pool loaded {len(got)} of {prefixes.num_pages} "
                                       "pages of a prefix")
        cache.demoter.flush(_SETTLE_S)
        return timed_loads(cache, site, by_way)
    finally:
        cache.close()


def timed_loads(cache: TieredCache, site: Site, by_way: dict[Way, list[Prefix]]) -> dict[Way, Timed]:
    """Load each prefix of `by_way` once in its way beside the limit, round by round (the ways'
    order and which of load and limit runs first alternating); each load is checked byte for
    byte, then its demotions are let finish."""
    ways = list(by_way)
    ours: dict[Way, list[float]] = {w: [] for w in ways}
    base: dict[Way, list[float]] = {w: [] for w in ways}
    work = dict.fromkeys(ways, 0)
    got = dict.fromkeys(ways, 0)
    for r in range(len(by_way[ways[0]])):
        for way in ways[r % len(ways):] + ways[:r % len(ways)]:
            prefix = by_way[way][r]
            baseline = site.baseline(prefix)
            if r % 2:
                seconds_base, got[way] = clock(baseline)
                seconds, placed = clock(lambda p=prefix, w=way: load(cache, p, w))
            else:
                seconds, placed = clock(lambda p=prefix, w=way: load(cache, p, w))
                seconds_base, got[way] = clock(baseline)
            work[way] = check_pool(cache, placed, prefix)
            del placed
            prefix.drop_pages()
            ours[way].append(seconds)
            base[way].append(seconds_base)
            cache.demoter.flush(_SETTLE_S)
    # One limit for every way: the same raw read, timed beside each of their loads (a way's own
    # median would carry where in the round its loads happened to fall).
    limit = statistics.median([t for w in ways for t in base[w]])
    return {w: Timed(statistics.median(ours[w]), limit, work[w], got[w], len(ours[w])) for w in ways}


def load(cache: TieredCache, prefix: Prefix, way: Way = Way.LOAD) -> Any:
    """Take `prefix` the way `way` says: the device pages it got (paged API), or (tokens, KV) (`get`)."""
    if way is Way.GET:
        return cache.get(prefix.tokens)
    handle = cache.match(prefix.tokens)
    try:
        if way is Way.PREFETCH:
            cache.prefetch(handle)
        return cache.load(handle)
    finally:
        cache.release(handle)


def check_pool(cache: TieredCache, got: Any, prefix: Prefix) -> int:
    """The bytes `load` placed, checked equal to the prefix's (else the figures are of a broken load)."""
    import torch

    if isinstance(got, tuple):  # get(): (tokens, KV)
        n, kv = got
        if n != len(prefix.tokens) or not torch.equal(kv, prefix.kv()):
            raise AssertionError(f"get() gave {n} of {len(prefix.tokens)} tokens, or wrong bytes")
        return kv.numel() * kv.element_size()
    if len(got) != prefix.num_pages or not torch.equal(cache.pool.gather(got), prefix.pages):
        raise AssertionError(f"the load gave {len(got)} of {prefix.num_pages} pages, or wrong bytes")
    return len(got) * cache.spec.bytes_per_page


def clock(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result
