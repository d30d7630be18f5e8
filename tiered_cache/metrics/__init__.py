"""Prometheus metrics: families read from stats at scrape time (families.py), histograms of what
happens on the request path (live.py), and the `/metrics` HTTP endpoint (http.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class StatsCollector(Collector):
    """Yields the families `build()` returns, built afresh at every scrape."""

    def __init__(self, build: Callable[[], list[Metric]]) -> None:
        self.build = build

    def collect(self) -> Iterator[Metric]:
        yield from self.build()


def registry_of(build: Callable[[], list[Metric]], registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """`registry` (a new one when None) with the families `build()` returns, read at every scrape."""
    registry = registry if registry is not None else CollectorRegistry()
    registry.register(StatsCollector(build))
    return registry
