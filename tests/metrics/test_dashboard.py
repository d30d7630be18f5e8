"""The Grafana dashboard queries only metrics the code exports, and the checked-in JSON is what
scripts/gen_dashboard.py writes."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.metrics import registry_of
from tiered_cache.metrics.families import cache_families, server_families, tier_families
from tiered_cache.metrics.live import LiveMetrics
from tiered_cache.model.spec import KVSpec
from tiered_cache.server.requests import ServerCounters

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "tiered-cache.json"
_NAME = re.compile(r"\$\{prefix\}(tiered_cache_[a-z_]+)")


def exported_sample_names() -> set[str]:
    """Every sample name a server and an engine-side cache export (counters with `_total`,
    histograms with `_bucket`, `_sum`, `_count`), read back from the exposition text."""
    with TieredCache(KVSpec("dash", 1, 1, 8, page_size=4), CacheConfig(pool_capacity="1MiB")) as cache:
        stats = cache.stats()
    registry = registry_of(lambda: [*tier_families(stats.tiers), *cache_families(stats),
                                    *server_families(ServerCounters(), 0)])
    live = LiveMetrics(registry)
    live.observe_get("disk", 0.01, 4096)
    live.prefetch_wait.observe(0.001)
    text = generate_latest(registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_metric_the_dashboard_queries_is_exported():
    exported = exported_sample_names()
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    queried = {name for expr in exprs for name in _NAME.findall(expr)}
    assert len(queried) >= 15 and all("${prefix}tiered_cache_" in e for e in exprs)
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for topic in ("hit rate", "bytes per tier", "get throughput", "p99", "queue", "errors"):
        assert topic in titles


def test_the_checked_in_dashboard_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("gen_dashboard", REPO / "scripts" / "gen_dashboard.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.loads(DASHBOARD.read_text()) == module.dashboard()
