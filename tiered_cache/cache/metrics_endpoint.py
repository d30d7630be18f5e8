"""A cache's own Prometheus endpoint (`CacheConfig.metrics_port`): its figures, live fetch
histograms, and `/tree` for `tiered-cache tree --url`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tiered_cache.cache.stats import CacheStats
from tiered_cache.config import CacheConfig
from tiered_cache.tiers.chain import TierChain


def serve_metrics(config: CacheConfig, stats: Callable[[], CacheStats], tree: Callable[[], dict[str, Any]],
                  chain: TierChain) -> tuple[Any, Any]:
    """Start the endpoint over a cache's `stats` and `prefix_tree`; returns (the `MetricsServer`,
    the `FetchMetrics` the chain's fetches feed)."""
    from tiered_cache.metrics import registry_of
    from tiered_cache.metrics.families import cache_families, tier_families
    from tiered_cache.metrics.http import MetricsServer
    from tiered_cache.metrics.live import FetchMetrics

    def build() -> list[Any]:
        figures = stats()
        return [*tier_families(figures.tiers), *cache_families(figures)]

    registry = registry_of(build)
    fetch_metrics = FetchMetrics(registry)
    chain.observe_fetches(fetch_metrics.fetched)
    routes = {"/tree": lambda: json.dumps(tree()).encode()}
    server = MetricsServer(registry, config.metrics_host, config.metrics_port or 0, config.metrics_token, routes)
    return server, fetch_metrics
