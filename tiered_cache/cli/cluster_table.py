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
    from tiered_cache.cli.cluster_cmd import node_label, router_lines
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
    return "\n".join([head, render_table(rows, _HEADERS, align_right=range(3, 15)), *notes,
                      *router_lines(figures), *render_vllm(figures.get("vllm"))])


_CONNECTOR = ["lookups", "blocks_asked", "blocks_hit", "blocks_loaded", "load_seconds", "blocks_saved",
              "saves_dropped", "load_failures", "load_errors", "hinted_blocks"]


def render_vllm(vllm: dict[str, Any] | None) -> list[str]:
    """The vLLM application's lines: its router's routes and fallbacks, then one row per replica
    with its connector's figures (empty when no application runs)."""
    if not vllm:
        return []
    if "error" in vllm:
        return [f"vLLM application: unreachable ({vllm['error']})"]
    lines = [f"vLLM application {vllm['app']}"]
    retried = vllm.get("retried") or {}
    if any(retried.values()):  # a replica died under requests: said only when it happened
        lines.append(f"  front end: {retried.get('requests_sent_again', 0):,} requests sent again, "
                     f"{retried.get('streams_resumed', 0):,} streams finished on another replica")
    if not vllm["routers"]:
        return [*lines, "  no routes or connector figures yet: Serve makes the router on the first request "
                        "(or its router is Ray's: --serve-router prefix or pow2)"]
    for router in vllm["routers"]:
        routed = ", ".join(f"{r} {n:,}" for r, n in sorted(router["routed"].items())) or "none yet"
        lines.append(f"  router: routed {routed}; in flight {sum(router['in_flight'].values())}; "
                     f"fallbacks {router['fallbacks']:,}; unparsed {router['unparsed']:,}")
        rows = [[f"replica {name}", *(_figure(k, figures.get(k, 0)) for k in _CONNECTOR)]
                for name, figures in sorted(router["connectors"].items())]
        if rows:
            lines.append(render_table(rows, ["connector", *(_header(k) for k in _CONNECTOR)],
                                      align_right=range(1, 1 + len(_CONNECTOR))))
    return lines


def _figure(name: str, value: float) -> str:
    return f"{1e3 * value:,.1f}" if name == "load_seconds" else f"{int(value):,}"


def _header(name: str) -> str:
    return "load ms" if name == "load_seconds" else name.replace("_", " ")
