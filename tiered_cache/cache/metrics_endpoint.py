"""A cache's own Prometheus endpoint (`CacheConfig.metrics_port`): its figures, live fetch
histograms, and `/tree` for `tiered-cache tree --url`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiered_cache.cache.tiered_cache import TieredCache


def serve_metrics(cache: TieredCache) -> tuple[Any, Any]:
    """Start the endpoint; returns (the `MetricsServer`, the `FetchMetrics` its fetches feed)."""
    from tiered_cache.metrics import registry_of
    from tiered_cache.metrics.families import cache_families, tier_families
    from tiered_cache.metrics.http import MetricsServer
    from tiered_cache.metrics.live import FetchMetrics

    def build() -> list[Any]:
        stats = cache.stats()
        return [*tier_families(stats.tiers), *cache_families(stats)]

    registry = registry_of(build)
    fetch_metrics = FetchMetrics(registry)
    cache.chain.observe_fetches(fetch_metrics.fetched)
    c = cache.config
    routes = {"/tree": lambda: json.dumps(cache.prefix_tree()).encode()}
    return MetricsServer(registry, c.metrics_host, c.metrics_port or 0, c.metrics_token, routes), fetch_metrics
