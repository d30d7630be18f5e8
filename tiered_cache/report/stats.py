"""A store server's figures as text (`tiered-cache stats`, the demo): its counters, then one row per
tier with rates."""

from __future__ import annotations

from typing import Any

from tiered_cache.model.units import format_binary
from tiered_cache.report.table import render_table


def tier_rates(result: dict[str, Any], before: dict[str, Any] | None, seconds: float) -> dict[str, dict[str, float]]:
    """Per tier: hits, misses and bytes out per second, since `before` (an earlier result of the
    same server) or, without one, since the server started."""
    if before is None or "error" in before:
        before, seconds = {"tiers": []}, float(result["server"].get("uptime_s", 0)) or 1.0
    earlier = {t["name"]: t for t in before["tiers"]}
    out = {}
    for t in result["tiers"]:
        e = earlier.get(t["name"], {})
        out[t["name"]] = {k: max(0, t[k] - e.get(k, 0)) / seconds for k in ("hits", "misses", "bytes_out")}
    return out


def render_stats(result: dict[str, Any], rates: dict[str, dict[str, float]] | None = None, over: str = "") -> str:
    """One `server_stats` result as text; `rates` per tier (from `tier_rates`; default: since the
    server started), `over` says over what interval they are. An unreachable server is one line."""
    if "error" in result:
        code = result.get("code")
        what = ("refused" if code in ("UNAUTHENTICATED", "PERMISSION_DENIED") else "TLS mismatch" if code == "TLS"
                else "unreachable")
        return f"{result['address']}: {what} ({result['error']})"
    rates = rates or tier_rates(result, None, 0)
    s = result["server"]
    head = (f"{result['address']}  tiered-cache {s.get('version', '?')}, up {float(s.get('uptime_s', 0)):,.0f} s, "
            f"{int(s.get('requests', 0)):,} requests, {int(s.get('rejected_requests', 0)):,} rejected, "
            f"{int(s.get('unauthenticated', 0)):,} unauthenticated, {int(s.get('refused_blobs', 0)):,} blobs refused, "
            f"{int(s.get('active_streams', 0))} streams open, {int(s.get('refused_streams', 0)):,} refused "
            f"(max_streams), {int(s.get('stalled_streams', 0)):,} ended stalled, "
            f"{int(s.get('cancelled_streams', 0)):,} cancelled by their client, "
            f"{int(s.get('shm_pages', 0)):,} pages handed out in place in the arena "
            f"({int(s.get('shm_pages_reused', 0)):,} with no copy), "
            f"{int(s.get('shm_put_pages', 0)):,} Put pages from clients' shared memory "
            f"({int(s.get('shm_offers', 0))} clients; their rings mapped here: "
            f"{format_binary(int(s.get('shm_offered_bytes', 0)))}, the clients' memory)")
    rows = [[t["name"], format_binary(t["capacity_bytes"]), format_binary(t["used_bytes"]), f"{t['pages']:,}",
             f"{t['hit_rate']:.1%}", f"{t['hits']:,}", f"{t['misses']:,}",
             f"{rates[t['name']]['hits']:,.1f}", f"{rates[t['name']]['misses']:,.1f}",
             f"{format_binary(rates[t['name']]['bytes_out'])}/s", f"{t['evictions']:,}",
             f"{t['loads']:,}", f"{t['demotions']:,}", format_binary(t["bytes_in"]),
             format_binary(t["bytes_out"]), f"{t['errors']:,}", f"{t['corrupt']:,}",
             f"{t.get('open_breakers', 0)} ({t.get('breaker_trips', 0):,} trips)"] for t in result["tiers"]]
    table = render_table(rows, ["tier", "capacity", "used", "pages", "hit rate", "hits", "misses", "hits/s",
                                "misses/s", "out/s", "evictions", "loaded", "demoted", "bytes in", "bytes out",
                                "errors", "corrupt", "open breakers"], align_right=range(1, 18))
    return f"{head}\n{table}\nrates {over or 'since the server started'}"
