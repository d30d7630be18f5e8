"""The backend's figures: per-batch pages and GB/s for SGLang's storage metrics (`get_stats`), and
our Prometheus endpoint over the store tier's figures (`metrics_port`).

Batch figures are kept only when SGLang collects them (`--enable-metrics`), and at most
`_BATCHES` of each between two of its reads: nobody reading never grows memory.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from tiered_cache.config import CacheConfig
from tiered_cache.tiers.remote import RemoteTier

_BATCHES = 1024
_FIGURES = ("prefetch_pgs", "prefetch_bandwidth", "backup_pgs", "backup_bandwidth")


class BatchStats:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._values: dict[str, deque[float]] = {name: deque(maxlen=_BATCHES) for name in _FIGURES}

    def record(self, kind: str, pages: int, page_bytes: int, start: float) -> None:
        """One batch of `kind` (prefetch or backup) that moved `pages` since `start`."""
        if self.enabled and pages:
            self._values[f"{kind}_pgs"].append(pages)
            seconds = max(time.perf_counter() - start, 1e-9)
            self._values[f"{kind}_bandwidth"].append(pages * page_bytes / seconds / 1e9)

    def drain(self) -> dict[str, list[float]]:
        """The figures since the last call, by `StorageMetrics` field."""
        return {name: [values.popleft() for _ in range(len(values))] for name, values in self._values.items()}


def serve_metrics(config: CacheConfig, remote: RemoteTier) -> Any:
    """Our Prometheus endpoint over `remote`'s figures when `metrics_port` is set; None otherwise."""
    if config.metrics_port is None:
        return None
    from tiered_cache.metrics import registry_of
    from tiered_cache.metrics.families import tier_families
    from tiered_cache.metrics.http import MetricsServer

    registry = registry_of(lambda: tier_families([remote.stats()], {"engine": "sglang"}))
    return MetricsServer(registry, config.metrics_host, config.metrics_port, config.metrics_token)
