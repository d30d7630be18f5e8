"""Prometheus metric families built from the figures the cache already keeps (`TierStats`,
`CacheStats`, the store server's counters), read at scrape time: nothing is counted twice, and
a scrape costs one `stats()` call.

Names follow Prometheus conventions: a `tiered_cache_` prefix, base units (`_bytes`, `_seconds`),
`_total` on counters, `_ratio` on shares. The same names are used by the Ray actors
(ray_metrics.py) and queried by `deploy/grafana/tiered-cache.json`; `METRIC_NAMES` lists them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tiered_cache.tiers.base import TierStats

PREFIX = "tiered_cache_"

# TierStats field -> (metric name without the prefix, kind, help).
TIER_FIELDS: dict[str, tuple[str, str, str]] = {
    "pages": ("tier_pages", "gauge", "Pages held by the tier"),
    "used_bytes": ("tier_used_bytes", "gauge", "Bytes the tier's pages take"),
    "capacity_bytes": ("tier_capacity_bytes", "gauge", "The tier's configured capacity"),
    "hits": ("tier_hits", "counter", "Pages asked of the tier and found"),
    "misses": ("tier_misses", "counter", "Pages asked of the tier and not found"),
    "demotions": ("tier_puts", "counter", "Pages written into the tier from the one above (or by a client)"),
    "evictions": ("tier_evictions", "counter", "Pages the tier dropped to stay within its capacity"),
    "loads": ("tier_loads", "counter", "Pages read from the tier to be loaded up"),
    "bytes_in": ("tier_written_bytes", "counter", "Bytes written into the tier"),
    "bytes_out": ("tier_read_bytes", "counter", "Bytes read out of the tier"),
    "errors": ("tier_errors", "counter", "Failed calls to the tier (down, timed out, full)"),
    "corrupt": ("tier_checksum_failures", "counter", "Blobs refused on read (checksum, truncation, wrong key)"),
    "breaker_trips": ("tier_breaker_trips", "counter", "Times a server's circuit breaker opened"),
    "open_breakers": ("tier_open_breakers", "gauge", "Servers whose circuit breaker is open or half-open now"),
}
HIT_RATIO = "tier_hit_ratio"


def _family(name: str, kind: str, doc: str, labels: list[str]) -> Metric:
    if kind == "counter":  # the client library appends `_total` to a counter family's samples
        return CounterMetricFamily(PREFIX + name, doc, labels=labels)
    return GaugeMetricFamily(PREFIX + name, doc, labels=labels)


def tier_families(tiers: Iterable[TierStats], extra: dict[str, str] | None = None) -> list[Metric]:
    """One family per `TIER_FIELDS` entry plus the hit ratio, a sample per tier (label `tier`,
    and `extra` labels on every sample, e.g. the Ray actor's name)."""
    extra = extra or {}
    labels = ["tier", *extra]
    families = {f: _family(name, kind, doc, labels) for f, (name, kind, doc) in TIER_FIELDS.items()}
    ratio = GaugeMetricFamily(PREFIX + HIT_RATIO, "Hits over hits and misses since start", labels=labels)
    for tier in tiers:
        values = [tier.name, *extra.values()]
        for field_name, family in families.items():
            family.add_metric(values, float(getattr(tier, field_name)))
        ratio.add_metric(values, tier.hit_rate)
    return [*families.values(), ratio]


def _single(name: str, kind: str, doc: str, value: float) -> Metric:
    """A family of one unlabelled sample."""
    family = _family(name, kind, doc, [])
    family.add_metric([], float(value))
    return family


def cache_families(stats: Any) -> list[Metric]:
    """The engine-side cache's own figures (a `CacheStats`): the device pool, the radix tree,
    the background queues (the write-behind demoter and the lower-tier writer) and the reuse
    policy's estimates and skipped pages."""
    pool = stats.pool
    pages = GaugeMetricFamily(PREFIX + "pool_pages", "Device pool pages by state", labels=["state"])
    pages.add_metric(["used"], pool.used_pages)
    pages.add_metric(["free"], pool.free_pages)
    depth = GaugeMetricFamily(PREFIX + "queue_depth", "Jobs waiting in a background queue", labels=["queue"])
    dropped = CounterMetricFamily(PREFIX + "queue_dropped", "Jobs a full background queue dropped", labels=["queue"])
    for q in stats.queues:
        depth.add_metric([q.name], q.depth)
        dropped.add_metric([q.name], q.dropped)
    return [pages, depth, dropped, *reuse_families(stats.reuse), *canary_families(stats.canary),
            *(_single(*row) for row in (
        ("pool_utilisation_ratio", "gauge", "Used device pool pages over all", pool.utilisation),
        ("pool_unused_slots", "gauge", "Token slots allocated in used pages but holding no token", pool.unused_slots),
        ("pool_fragmentation_ratio", "gauge", "Unused token slots over all slots of the pages in use",
         stats.fragmentation),
        ("pool_shared_pages", "gauge", "Device pages more than one holder shares (forks, the tree)",
         pool.shared_pages),
        ("forks", "counter", "Handles made by fork() (copy-on-write sequences)", pool.forks),
        ("cow_copies", "counter", "Shared pages copied because a fork wrote into them", pool.cow_copies),
        ("swapped_pages", "gauge", "Host RAM slots holding swapped-out requests' pages", pool.swapped_pages),
        ("compacted_pages", "counter", "Private pages freed by retention policies", pool.compacted_pages),
        ("uncopied_evictions", "counter", "Device pages evicted on the request path without a copy: a lower "
         "tier held them", pool.uncopied_evictions),
        ("tree_nodes", "gauge", "Nodes of the radix tree of token prefixes", stats.tree_nodes),
        ("tree_evictable_pages", "gauge", "Device pages no request holds (evictable)", stats.evictable_pages),
        ("prefetch_declined", "counter", "Prefetches not started: too many in flight", stats.prefetch_declined),
        ("skipped_puts", "counter", "Lower-tier puts avoided: the tier was known to hold the page",
         stats.skipped_puts),
        ("dropped_pages", "counter", "Pages whose write below was dropped: the write-behind was full",
         stats.dropped_pages),
    ))]


def canary_families(canary: Any) -> list[Metric]:
    """The correctness canary's figures (a `CanaryStats`, or None): hits checked against
    recomputation, mismatches, checks dropped while busy, and the tiers quarantined."""
    if canary is None:
        return []
    quarantined = GaugeMetricFamily(PREFIX + "canary_quarantined", "Tiers not loaded from because the canary found "
                                    "their pages wrong (1 per namespace and tier)", labels=["namespace", "tier"])
    for namespace, tiers in canary.quarantined.items():
        for tier in tiers:
            quarantined.add_metric([namespace, tier], 1)
    return [quarantined, *(_single(*row) for row in (
        ("canary_checks", "counter", "Cache hits recomputed and compared with the reused KV", canary.checks),
        ("canary_mismatches", "counter", "Checked hits with a page that differed from recomputation",
         canary.mismatches),
        ("canary_dropped", "counter", "Hits due a check that found the canary busy", canary.dropped),
        ("canary_pages_wrong", "counter", "Reused pages that differed from recomputation", canary.pages_wrong),
    ))]


def reuse_families(reuse: Any) -> list[Metric]:
    """The reuse policy's figures (a `ReuseStats`, or None): pages skipped as slower to load
    than to recompute, by tier; each tier's estimated load rate and per-call latency; the prefill
    rate planned with (absent until known)."""
    if reuse is None:
        return []
    skipped = CounterMetricFamily(PREFIX + "reuse_skipped_pages", "Cached pages left for the engine to recompute: "
                                  "loading them was estimated slower (reuse policy)", labels=["tier"])
    for tier, n in reuse.skipped_pages.items():
        skipped.add_metric([tier], n)
    rate = GaugeMetricFamily(PREFIX + "reuse_load_rate_bytes_per_second", "Estimated rate of loading pages from "
                             "a tier into the device pool", labels=["tier"])
    latency = GaugeMetricFamily(PREFIX + "reuse_load_latency_seconds", "Estimated fixed cost of one load from a "
                                "tier", labels=["tier"])
    seen = GaugeMetricFamily(PREFIX + "reuse_load_seen_up_to_bytes", "Largest recent load from a tier, where "
                             "its estimate has no latency fitted: past it the estimate is a guess, and the tier "
                             "is probed when skipped on it", labels=["tier"])
    for tier, fit in reuse.load_rates.items():
        rate.add_metric([tier], fit.per_s)
        latency.add_metric([tier], fit.latency_s)
        if not math.isinf(fit.known_up_to):
            seen.add_metric([tier], fit.known_up_to)
    out = [skipped, rate, latency, seen]
    if reuse.prefill_tokens_per_s is not None:
        out.append(_single("reuse_prefill_rate_tokens_per_second", "gauge",
                           "Prefill rate the reuse policy plans with (configured or measured)",
                           reuse.prefill_tokens_per_s))
    return out


def server_families(counters: Any, streams_open: int, shm_pages: int = 0, shm_pages_reused: int = 0,
                    shm_offered_bytes: int = 0) -> list[Metric]:
    """The store server's own counters (server/requests.py's ServerCounters: Put pages taken from clients'
    shared memory among them), its open streams and the Get pages it handed over through its
    shared-memory ring."""
    return [_single(*row) for row in (
        ("server_requests", "counter", "Calls the store server answered", counters.requests),
        ("server_rejected_requests", "counter", "Calls refused as malformed (INVALID_ARGUMENT)", counters.rejected),
        ("server_unauthenticated_requests", "counter", "Calls refused for a missing or wrong token",
         counters.unauthenticated),
        ("server_refused_blobs", "counter", "Blobs a Put refused (too big, wrong fingerprint, bad checksum)",
         counters.refused_blobs),
        ("server_stalled_streams", "counter", "Streams ended for making no progress", counters.stalled_streams),
        ("server_cancelled_streams", "counter", "Get and Put streams their client cancelled",
         counters.cancelled_streams),
        ("server_open_streams", "gauge", "Get and Put streams open now", streams_open),
        ("server_shm_pages", "counter", "Pages handed to same-host clients by reference into the arena (Lookup, Get)",
         shm_pages),
        ("server_shm_pages_reused", "counter", "Of those, pages already in the arena: handed out with no copy",
         shm_pages_reused),
        ("server_shm_put_pages", "counter", "Put pages read from same-host clients' shared memory (no bytes sent)",
         counters.shm_put_pages),
        ("server_shm_offered_bytes", "gauge", "Bytes of same-host clients' Put rings mapped now: the clients' "
         "memory, in the server's RSS too", shm_offered_bytes),
    )]
