"""The `stats --ray` table: one row per tier of every worker and shard, then the cluster totals."""

from __future__ import annotations

from typing import Any

from tiered_cache.model.units import format_binary
from tiered_cache.report.table import render_table

_HEADERS = ["actor", "node", "tier", "pages", "used", "capacity", "hit rate", "hits", "misses", "evictions",
            "bytes in", "bytes out", "errors", "corrupt", "open breakers"]


def _row(actor: str, node: str, tier: dict[str, Any]) -> list[str]:
    asked = int(tier["hits"]) + int(tier["misses"])
    rate = f"{int(tier['hits']) / asked:.1%}" if asked else "-"
    return [actor, node, tier["name"], f"{int(tier['pages']):,}", format_binary(int(tier["used_bytes"])),
            format_binary(int(tier["capacity_bytes"])), rate, f"{int(tier['hits']):,}", f"{int(tier['misses']):,}",
            f"{int(tier['evictions']):,}", format_binary(int(tier["bytes_in"])), format_binary(int(tier["bytes_out"])),
            f"{int(tier['errors']):,}", f"{int(tier['corrupt']):,}", f"{int(tier.get('open_breakers', 0)):,}"]


def render_cluster(figures: dict[str, Any]) -> str:
    from tiered_cache.cli.cluster_cmd import node_label
    from tiered_cache.report.tree import canary_line, reuse_line
    from tiered_cache.workers.cluster import tiers_of

    rows, notes = [], []
    for actor in figures["actors"]:
        if "error" in actor:
            notes.append(f"{actor['name']}: unreachable ({actor['error']})")
            continue
        label = f"{actor['kind']} {actor['name']}"
        for tier in tiers_of(actor):
            rows.append(_row(label, node_label(actor), tier))
        if reuse := reuse_line(actor.get("cache", {}).get("reuse")):
            notes.append(f"{actor['name']}: {reuse}")
        if canary := canary_line(actor.get("cache", {}).get("canary")):
            notes.append(f"{actor['name']}: {canary}")
    for name, tier in figures["totals"].items():
        rows.append(_row("cluster total", "", {"name": name, **tier}))
    workers = sum(a["kind"] == "worker" and "error" not in a for a in figures["actors"])
    shards = sum(a["kind"] == "shard" and "error" not in a for a in figures["actors"])
    head = f"{workers} worker(s), {shards} shard(s)"
    return "\n".join([head, render_table(rows, _HEADERS, align_right=range(3, 15)), *notes])
