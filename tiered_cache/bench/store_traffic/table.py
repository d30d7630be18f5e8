"""`bench store-traffic`'s printed report: tables with units, and the RSS verdict with its two numbers
(`bench store-traffic --ray`'s is ray_table.py)."""

from __future__ import annotations

from tiered_cache.bench.store_traffic.report import TrafficResult
from tiered_cache.bench.store_traffic.rss import PLATEAU_GROWTH, PLATEAU_SLACK
from tiered_cache.bench.timing import render_comparisons
from tiered_cache.model.units import format_binary
from tiered_cache.report.table import render_table
from tiered_cache.tiers.base import Tier


def render_traffic(result: TrafficResult) -> str:
    r = result
    lines = [f"{r.clients} client processes for {r.window_s:.1f} s: {r.requests:,} requests "
             f"({r.requests / r.window_s:,.1f} requests/s), every one Lookup, Get of the held pages, Put of the rest"]
    ops = [*r.ops, r.baseline]
    lines.append(render_table(
        [[o.op, f"{o.calls:,}", f"{o.per_s:,.1f}", f"{o.p50_ms:.2f}", f"{o.p99_ms:.2f}", f"{o.p999_ms:.2f}"]
         for o in ops], ["operation", "calls", "calls/s", "p50 ms", "p99 ms", "p999 ms"], align_right=(1, 2, 3, 4, 5)))
    lines += ["", "same-run baseline: as many processes each doing 1-key Lookups, before the mix",
              render_comparisons(r.comparisons(), "clients"), ""]
    errors = ", ".join(f"{kind}: {n:,}" for kind, n in r.errors.items()) or "none"
    distinct = r.distinct_pages * r.blob_bytes
    ram = next((t for t in r.tiers if t.name == Tier.RAM), None)
    times_ram = f", {distinct / ram.capacity:.1f}x the RAM tier" if ram and ram.capacity else ""
    lines += [f"errors by kind: {errors}",
              f"pages compared byte for byte: {r.pages_compared:,} (wrong_bytes: {r.wrong_bytes:,}); held at the "
              f"Lookup but evicted by the Get: {r.pages_missing:,}",
              f"pages put: {r.pages_put:,} ({format_binary(r.pages_put * r.blob_bytes)}); distinct pages made: "
              f"{r.distinct_pages:,} of {format_binary(r.blob_bytes)} ({format_binary(distinct)}{times_ram})"]
    if r.tiers:
        lines.append(render_table([[t.name, format_binary(t.used), format_binary(t.capacity), f"{t.pages:,}",
                                    f"{t.evictions:,}"] for t in r.tiers],
                                  ["server tier", "used", "capacity", "pages", "evictions"], align_right=(1, 2, 3, 4)))
    lines.append(_rss_text(r))
    if r.png:
        lines.append(f"figure: {r.png}")
    return "\n".join(lines)


def _rss_text(r: TrafficResult) -> str:
    if not r.rss:
        return "server RSS: not sampled (a server started elsewhere: give --server-pid)"
    during = [b for t, b in r.rss if 0 <= t <= r.window_s] or [b for _, b in r.rss]
    text = (f"server RSS ({len(r.rss)} samples): {format_binary(r.rss[0][1])} before the baseline, "
            f"{format_binary(min(during))} to {format_binary(max(during))} during the mix")
    p = r.plateau
    if p is None:
        return text + "; too few samples for a verdict"
    limit = f"< {PLATEAU_GROWTH:.0%} or < {format_binary(PLATEAU_SLACK)}"
    verdict = "plateau" if p.levelled_off else "STILL GROWING"
    return (text + f"\n  median over the middle third: {format_binary(p.middle_median)}, over the last third: "
            f"{format_binary(p.last_median)} (largest {format_binary(p.middle_max)}, {format_binary(p.last_max)}), "
            f"growth {format_binary(p.growth)} ({p.growth_pct:+.1f}%; plateau means "
            f"{limit}): {verdict}")
