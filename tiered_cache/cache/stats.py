"""Figures of a whole `TieredCache`: one `TierStats` per tier, plus pool and tree figures."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tiered_cache.cache.background import QueueStats
from tiered_cache.cache.canary import CanaryStats
from tiered_cache.cache.reuse import ReuseStats
from tiered_cache.tiers.base import TierStats


@dataclass
class Movements:
    """Pages the cache moved between tiers, by tier name (the tiers cannot tell direction)."""

    loads: Counter[str] = field(default_factory=Counter)
    demotions: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # blobs that passed the tier, failed decode
    uncopied_evictions: int = 0  # device pages evicted on the request path without a copy: safe below

    def apply(self, stats: TierStats) -> TierStats:
        """A copy of a tier's own figures with the cache's movements filled in."""
        name = stats.name
        return replace(stats, loads=self.loads[name], demotions=self.demotions[name],
                       corrupt=stats.corrupt + self.refused[name])


@dataclass(frozen=True)
class PoolStats:
    total_pages: int
    used_pages: int
    free_pages: int
    page_bytes: int
    unused_slots: int  # token slots allocated to live requests but not (yet) filled
    shared_pages: int = 0  # pages more than one holder (forks, the tree) holds: stored once
    forks: int = 0  # handles made by fork()
    cow_copies: int = 0  # shared pages copied because a fork wrote into them
    swapped_pages: int = 0  # host RAM rows holding swapped-out requests' private pages
    compacted_pages: int = 0  # private pages freed by retention policies (drop_tokens)
    uncopied_evictions: int = 0  # evicted on the request path without a copy: a lower tier held them

    @property
    def utilisation(self) -> float:
        return self.used_pages / self.total_pages


@dataclass(frozen=True)
class CacheStats:
    tiers: list[TierStats]
    pool: PoolStats
    page_size: int
    tree_nodes: int
    evictable_pages: int
    protected_pages: int
    queues: list[QueueStats] = field(default_factory=list)  # background work: depth, dropped, ...
    prefetch_declined: int = 0  # prefetches not started because max_prefetches were in flight
    skipped_puts: int = 0  # lower-tier puts avoided: the tier was known to hold the page
    dropped_pages: int = 0  # pages whose write below was dropped: the write-behind was full
    reuse: ReuseStats | None = None  # load and prefill rate estimates, pages left to recompute
    canary: CanaryStats | None = None  # hits checked against recomputation, tiers quarantined

    def queue(self, name: str) -> QueueStats:
        return next(q for q in self.queues if q.name == name)

    def tier(self, name: str) -> TierStats:
        return next(t for t in self.tiers if t.name == name)

    @property
    def fragmentation(self) -> float:
        """Unused token slots over all token slots of the pages in use."""
        slots = self.pool.used_pages * self.page_size
        return self.pool.unused_slots / slots if slots else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "tiers": [t.to_dict() for t in self.tiers],
            "pool": {
                "total_pages": self.pool.total_pages, "used_pages": self.pool.used_pages,
                "free_pages": self.pool.free_pages, "page_bytes": self.pool.page_bytes,
                "utilisation": self.pool.utilisation, "unused_slots": self.pool.unused_slots,
                "fragmentation": self.fragmentation, "shared_pages": self.pool.shared_pages,
                "forks": self.pool.forks, "cow_copies": self.pool.cow_copies,
                "swapped_pages": self.pool.swapped_pages, "compacted_pages": self.pool.compacted_pages,
                "uncopied_evictions": self.pool.uncopied_evictions,
            },
            "tree": {"nodes": self.tree_nodes, "evictable_pages": self.evictable_pages,
                     "protected_pages": self.protected_pages},
            "queues": [asdict(q) for q in self.queues],
            "prefetch_declined": self.prefetch_declined,
            "skipped_puts": self.skipped_puts,
            "dropped_pages": self.dropped_pages,
            "reuse": self.reuse.to_dict() if self.reuse is not None else None,
            "canary": self.canary.to_dict() if self.canary is not None else None,
        }


def cache_stats(cache: Any) -> CacheStats:
    """The figures `TieredCache.stats()` returns (`cache`: the `TieredCache`; typed loosely, as the
    cache imports this module): the device's and host RAM's read under the cache's lock, the lower
    tiers' outside it (their calls may wait on a network)."""
    core = cache.core
    with core.lock:
        device, pool, size, nodes = core.ledger.stats()
        pool = replace(pool, uncopied_evictions=core.moves.uncopied_evictions)
        tiers = [device, core.moves.apply(core.host.stats())]
    tiers += [replace(t, corrupt=t.corrupt + core.moves.refused[t.name]) for t in core.chain.stats()]
    return CacheStats(tiers, pool, core.spec.page_size, nodes, size.evictable, size.protected,
                      [cache.demoter.stats(), core.writer.stats()], cache.loader.tier_loads.declined,
                      core.chain.skipped_puts, core.writer.pages_dropped, core.reuse.estimates.stats(),
                      cache.canary.stats())
