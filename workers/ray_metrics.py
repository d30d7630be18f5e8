"""The cache's metrics from inside Ray actors, through `ray.util.metrics`, so they appear in Ray's
own Prometheus export (and its Grafana) beside Ray's metrics.

The families are the ones `/metrics` serves (tiered_cache/metrics/families.py), mirrored every
`interval_s`: a gauge is set, a counter is increased by what it grew since the last mirror (Ray
refuses an increase of 0, so a counter appears once it has grown). Every sample gets an `actor`
tag. Ray's export prefixes each name with `ray_` (a counter also gets
`_total`): `tiered_cache_tier_hits` becomes `ray_tiered_cache_tier_hits_total`, which is what the
Grafana dashboard queries with its prefix set to `ray_`. The tier get histograms are observed as
they happen (`observe_get`), under live.py's names and in its buckets.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ray.util import metrics as ray_metrics

from tiered_cache.metrics.families import PREFIX
from tiered_cache.metrics.live import BYTES_BUCKETS, SECONDS_BUCKETS

log = logging.getLogger("tiered_cache.workers.metrics")


class RayMetrics:
    def __init__(self, actor: str, build: Callable[[], list[Any]], interval_s: float = 5.0) -> None:
        self.actor, self.build, self.interval_s = actor, build, interval_s
        self._metrics: dict[str, Any] = {}
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        tags = ("tier", "actor")
        self._get_seconds = ray_metrics.Histogram(PREFIX + "tier_get_seconds", "Seconds of one batched get from a "
                                                  "tier", boundaries=list(SECONDS_BUCKETS), tag_keys=tags)
        self._get_bytes = ray_metrics.Histogram(PREFIX + "tier_get_bytes", "Bytes of one batched get from a tier",
                                                boundaries=list(BYTES_BUCKETS), tag_keys=tags)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiered-cache-ray-metrics", daemon=True)

    def start(self) -> RayMetrics:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def observe_get(self, tier: str, seconds: float, nbytes: int) -> None:
        tags = {"tier": tier, "actor": self.actor}
        self._get_seconds.observe(seconds, tags=tags)
        self._get_bytes.observe(float(nbytes), tags=tags)

    def publish(self) -> int:
        """Mirror every family once; returns the samples published."""
        published = 0
        for family in self.build():
            for sample in family.samples:
                tags = {**sample.labels, "actor": self.actor}
                metric = self._metric(family, tuple(tags))
                if family.type == "counter":
                    key = (family.name, tuple(sorted(tags.items())))
                    grown = sample.value - self._last.get(key, 0.0)
                    self._last[key] = sample.value
                    if grown > 0:
                        metric.inc(grown, tags=tags)
                else:
                    metric.set(sample.value, tags=tags)
                published += 1
        return published

    def _metric(self, family: Any, tag_keys: tuple[str, ...]) -> Any:
        metric = self._metrics.get(family.name)
        if metric is None:
            kind = ray_metrics.Counter if family.type == "counter" else ray_metrics.Gauge
            metric = self._metrics[family.name] = kind(family.name, family.documentation, tag_keys=tag_keys)
        return metric

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish()
            except Exception:  # a stats call failed mid-shutdown, say: the next round tries again
                log.warning("%s: publishing metrics failed", self.actor, exc_info=True)
