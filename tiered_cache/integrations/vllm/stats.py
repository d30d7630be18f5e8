"""Our connector's figures in vLLM's own metrics: `TieredCacheStats` (what the connector counted
since vLLM last asked, `get_kv_connector_stats`: the scheduler side its lookups and saves, the
worker side its loads, which vLLM adds together) and `TieredCachePromMetrics`
(counters `vllm:tiered_cache_*` in vLLM's Prometheus registry, the one its `/metrics` serves,
labelled per engine as vLLM's own are), and `TOTALS`, their sums in this process."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# name -> help: each a count of the interval, summed across workers and added to a counter.
COUNTERS = {
    "lookups": "Requests whose prompt had full blocks past vLLM's own prefix cache, asked of tiered-cache",
    "blocks_asked": "Full prompt blocks past vLLM's own prefix cache tiered-cache was asked about",
    "blocks_hit": "Of those, the leading blocks tiered-cache held (loaded)",
    "blocks_saved": "Blocks handed to tiered-cache's tiers to save",
    "saves_dropped": "Block saves dropped because the save queue was full",
    "load_failures": "Blocks a lookup promised that could not be loaded (vLLM recomputed them)",
    "load_errors": "Pages found but refused on decode (checksum, identity): recomputed",
    "blocks_loaded": "Blocks copied from tiered-cache's tiers into vLLM's KV",
    # What a load costs a request's TTFT, as the engine lived it (a load started ahead on a
    # router's hint costs only what is left of it): the router prices the store by it.
    "load_seconds": "Seconds vLLM's forward steps waited for tiered-cache's loads",
}


# This process's sums of what the metrics were told, whatever holds the counters (prometheus_client,
# or Ray's metrics under Ray Serve LLM, which cannot be read back): a replica reports them.
TOTALS: dict[str, float] = dict.fromkeys(COUNTERS, 0)


class TieredCacheStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class TieredCachePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name, description in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:tiered_cache_{name}", documentation=description,
                                        labelnames=labelnames)
            self.counters[name] = {engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in TOTALS and value:
                TOTALS[name] += value
            per_engine = self.counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)


class Tally:
    """The scheduler side's counts since the last `take` (BlockTiers' own counters are totals:
    their growth is added)."""

    def __init__(self, tiers: Any) -> None:
        self.tiers = tiers
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._seen = self._totals()

    def _totals(self) -> dict[str, int]:
        return {"saves_dropped": self.tiers.saves_dropped, "load_failures": self.tiers.load_failures,
                "load_errors": self.tiers.load_errors}

    def add(self, **counts: int) -> None:
        for name, value in counts.items():
            self.counts[name] += value

    def take(self) -> TieredCacheStats | None:
        totals = self._totals()
        for name, total in totals.items():
            self.counts[name] += total - self._seen[name]
        self._seen = totals
        counts, self.counts = self.counts, dict.fromkeys(COUNTERS, 0)
        return TieredCacheStats(data=counts) if any(counts.values()) else None


class Loads:
    """The worker side's loads since the last `take`: blocks copied into vLLM's KV and the
    seconds the forward steps waited for them."""

    def __init__(self) -> None:
        self.blocks = 0
        self.seconds = 0.0

    def add(self, blocks: int, seconds: float) -> None:
        self.blocks += blocks
        self.seconds += seconds

    def take(self) -> TieredCacheStats | None:
        if not self.blocks and not self.seconds:
            return None
        data = {"blocks_loaded": self.blocks, "load_seconds": self.seconds}
        self.blocks, self.seconds = 0, 0.0
        return TieredCacheStats(data=data)
