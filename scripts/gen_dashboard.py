"""Write deploy/grafana/tiered-cache.json: the Grafana dashboard for tiered-cache's metrics.

    python scripts/gen_dashboard.py   # after changing a panel here; the JSON is checked in

Every query uses `${prefix}tiered_cache_...`: the prefix variable is empty for a store server or
an engine scraped directly, and `ray_` for Ray actors (Ray's Prometheus export prefixes the
names of `ray.util.metrics`). tests/metrics/test_dashboard.py checks every name queried is one we export.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "tiered-cache.json"
P = "${prefix}tiered_cache_"

PANELS = [  # title, unit, [(expr, legend)]
    ("Hit rate per tier", "percentunit",
     [(f"sum by (tier) (rate({P}tier_hits_total[5m])) / (sum by (tier) (rate({P}tier_hits_total[5m])) "
       f"+ sum by (tier) (rate({P}tier_misses_total[5m])))", "{{tier}}")]),
    ("Bytes per tier vs capacity", "bytes",
     [(f"sum by (tier) ({P}tier_used_bytes)", "{{tier}} used"),
      (f"sum by (tier) ({P}tier_capacity_bytes)", "{{tier}} capacity")]),
    ("Get throughput from tiers below host RAM", "Bps",
     [(f"sum by (tier) (rate({P}tier_get_bytes_sum[1m]))", "{{tier}} gets"),
      (f"sum by (tier) (rate({P}tier_read_bytes_total[1m]))", "{{tier}} read out")]),
    ("p99 get latency", "s",
     [(f"histogram_quantile(0.99, sum by (le, tier) (rate({P}tier_get_seconds_bucket[5m])))", "{{tier}} p99"),
      (f"histogram_quantile(0.99, sum by (le) (rate({P}prefetch_wait_seconds_bucket[5m])))", "prefetch wait p99")]),
    ("Background queues (write-behind demoter, lower-tier writer)", "short",
     [(f"sum by (queue) ({P}queue_depth)", "{{queue}} depth"),
      (f"sum by (queue) (rate({P}queue_dropped_total[5m]))", "{{queue}} dropped/s"),
      (f"rate({P}dropped_pages_total[5m])", "pages not written below/s")]),
    ("Errors", "short",
     [(f"sum by (tier) (rate({P}tier_errors_total[5m]))", "{{tier}} errors/s"),
      (f"sum by (tier) (rate({P}tier_checksum_failures_total[5m]))", "{{tier}} checksum failures/s"),
      (f"sum by (tier) ({P}tier_open_breakers)", "{{tier}} open breakers"),
      (f"rate({P}server_rejected_requests_total[5m])", "server: malformed calls/s"),
      (f"rate({P}server_unauthenticated_requests_total[5m])", "server: unauthenticated calls/s")]),
    ("Device pool", "percentunit",
     [(f"{P}pool_utilisation_ratio", "utilisation"), (f"{P}pool_fragmentation_ratio", "fragmentation")]),
    ("Pages moved", "short",
     [(f"sum by (tier) (rate({P}tier_puts_total[5m]))", "{{tier}} puts/s"),
      (f"sum by (tier) (rate({P}tier_evictions_total[5m]))", "{{tier}} evictions/s"),
      (f"sum by (tier) (rate({P}tier_loads_total[5m]))", "{{tier}} loads/s")]),
]


def panel(index: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict:
    return {
        "title": "tiered-cache", "uid": "tiered-cache", "schemaVersion": 39, "version": 1,
        "tags": ["tiered-cache", "kv-cache"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "prefix", "type": "custom", "label": "metric prefix",
             "query": " ,ray_", "current": {"text": "", "value": ""},
             "options": [{"text": "(direct scrape)", "value": "", "selected": True},
                         {"text": "ray_ (Ray actors)", "value": "ray_", "selected": False}]},
        ]},
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")
