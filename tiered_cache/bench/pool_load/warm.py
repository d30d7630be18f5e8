"""`bench pool-load`'s side column: the warm loop. One prefix, loaded again and again by one warm
reader whose pool has room: before each round the prefix is dropped from the pool and host RAM
(only the tier below holds it), then loaded as engines load (`match` + `prefetch` + `load`)
beside the path's limit, alternating which goes first; the first round warms up. For host RAM, each round demotes the
pool into host RAM (`evict`, timed too: "pool -> host RAM") and loads it back. This flatters
every path (the pages, the maps, the page cache are all warm): the serving rounds
(serving.py) are the headline.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from tiered_cache.bench.pool_load.prefixes import Prefix, Prefixes
from tiered_cache.bench.pool_load.serving import Timed, check_pool, clock, load, reader

if TYPE_CHECKING:
    from tiered_cache.bench.pool_load.sites import Site
    from tiered_cache.cache import TieredCache


def warm_rounds(site: Site, prefixes: Prefixes, rounds: int) -> tuple[Timed, Timed | None]:
    """(the load, and for host RAM the demotion) of prefix 0 of `site`, warm (see the module doc)."""
    prefix = prefixes[0]
    cache = reader(prefixes, site.settings, 2, 2)
    baseline = site.baseline(prefix)
    host, tensor = site.path == "host", site.path == "tensor"
    try:
        cache.warming.join()
        if host or tensor:
            cache.put(prefix.tokens, prefix.kv())
        if tensor:  # in host RAM for good: get() reads it from there every round
            cache.evict()
        ours, base, demote = [], [], []
        placed, got = None, 0
        for r in range(rounds + 1):  # round 0 warms up
            if host:
                drop_host_copies(cache, prefix)
                seconds_demote, _ = clock(cache.evict)
            elif not tensor:
                cache.evict()
                cache.flush()
                drop_host_copies(cache, prefix)
            if r % 2:
                seconds, placed = clock(lambda: load(cache, prefix, site.way))
                seconds_base, got = clock(baseline)
            else:
                seconds_base, got = clock(baseline)
                seconds, placed = clock(lambda: load(cache, prefix, site.way))
            if r:
                ours.append(seconds)
                base.append(seconds_base)
                if host:
                    demote.append(seconds_demote)
        assert placed is not None
        work = check_pool(cache, placed, prefix)
        loaded = Timed(statistics.median(ours), statistics.median(base), work, got, rounds)
        demoted = Timed(statistics.median(demote), statistics.median(base), work, got, rounds) if host else None
        return loaded, demoted
    finally:
        cache.close()


def drop_host_copies(cache: TieredCache, prefix: Prefix) -> None:
    """Forget the prefix's pages in host RAM. No public call does this; host RAM's index is
    guarded by the cache's lock, so it is taken here."""
    with cache.core.lock:
        cache.host.delete(prefix.keys)
