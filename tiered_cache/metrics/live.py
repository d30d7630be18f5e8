"""Histograms observed as things happen (the rest is read from stats at scrape time): each batched
get from a tier below host RAM (seconds and bytes) and the time `load()` waited for a prefetch."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from tiered_cache.metrics.families import PREFIX

SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 11))  # 4 KiB .. 1 GiB


class LiveMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()  # a cache's endpoint serves it
        registry = self.registry
        self.seconds = Histogram(PREFIX + "tier_get_seconds", "Seconds of one batched get from a tier", ["tier"],
                                 registry=registry, buckets=SECONDS_BUCKETS)
        self.bytes = Histogram(PREFIX + "tier_get_bytes", "Bytes of one batched get from a tier", ["tier"],
                               registry=registry, buckets=BYTES_BUCKETS)
        self.prefetch_wait = Histogram(PREFIX + "prefetch_wait_seconds", "Seconds load() waited for a prefetch",
                                       registry=registry, buckets=SECONDS_BUCKETS)

    def observe_get(self, tier: str, seconds: float, nbytes: int) -> None:
        """A `TierChain` get observer (`observe_gets`)."""
        self.seconds.labels(tier).observe(seconds)
        self.bytes.labels(tier).observe(nbytes)
