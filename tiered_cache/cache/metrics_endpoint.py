"""A cache's own Prometheus endpoint (`CacheConfig.metrics_port`): its figures, live
histograms, and `/tree` for `tiered-cache tree --url`."""

from __future__ import annotations

import json
from typing import Any


def serve_metrics(cache: Any) -> Any:
    """Start the endpoint over `cache.stats()` and `cache.prefix_tree()` on the config's metrics
    port, beside the live histograms the core made (`CacheCore.live_metrics`: the chain's gets and
    the loader's prefetch waits feed them); returns the `MetricsServer`."""
    from tiered_cache.metrics import registry_of
    from tiered_cache.metrics.families import cache_families, tier_families
    from tiered_cache.metrics.http import MetricsServer

    config = cache.config

    def build() -> list[Any]:
        figures = cache.stats()
        return [*tier_families(figures.tiers), *cache_families(figures)]

    registry = registry_of(build, cache.core.live_metrics.registry)
    routes = {"/tree": lambda: json.dumps(cache.prefix_tree()).encode()}
    return MetricsServer(registry, config.metrics_host, config.metrics_port or 0, config.metrics_token, routes)
