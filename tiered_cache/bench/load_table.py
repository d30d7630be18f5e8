"""`bench load`'s printed report: tables with units, and the RSS verdict with its two numbers.
`bench load --ray`'s: each phase's figures, the comparison with recompute, the answer check, the
cluster's tiers, and each actor's memory with its plateau verdict."""

from __future__ import annotations

from tiered_cache.bench.load_report import LoadResult, PhaseFigures, ProcessMemory, RayLoadResult
from tiered_cache.bench.load_rss import PLATEAU_GROWTH, PLATEAU_SLACK
from tiered_cache.bench.timing import render_comparisons
from tiered_cache.model.units import format_binary
from tiered_cache.report.table import render_table


def render_load(result: LoadResult) -> str:
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
    ram = next((t for t in r.tiers if t.name == "ram"), None)
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


def _rss_text(r: LoadResult) -> str:
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


def _phase_row(p: PhaseFigures) -> list[str]:
    return [p.phase, f"{p.window_s:.1f}", f"{p.requests:,}", f"{p.per_s:,.2f}", f"{p.p50_ms:,.0f}",
            f"{p.p99_ms:,.0f}", f"{p.p999_ms:,.0f}", f"{p.ttft_p50_ms:,.0f}", f"{p.ttft_p99_ms:,.0f}",
            f"{p.saved_share:.1%}", f"{sum(p.errors.values()):,}"]


def _memory_row(m: ProcessMemory) -> list[str]:
    during = [b for t, b in m.samples if t >= 0] or [b for _, b in m.samples] or [0]
    p = m.plateau
    verdict = "too few samples" if p is None else ("plateau" if p.levelled_off else "STILL GROWING")
    growth = f"{format_binary(p.growth)} ({p.growth_pct:+.1f}%)" if p else "-"
    peak = format_binary(p.peak_growth) if p else "-"
    return [m.name, f"{len(m.samples):,}", format_binary(min(during)), format_binary(max(during)), growth, peak,
            verdict]


def render_ray_load(result: RayLoadResult) -> str:
    r = result
    lines = [f"{r.cache.clients} client actors through the router to {r.workers} worker(s) and {r.shards} shard(s), "
             f"{r.max_new_tokens} new tokens per request",
             render_table([_phase_row(r.recompute), _phase_row(r.cache)],
                          ["phase", "s", "requests", "req/s", "p50 ms", "p99 ms", "p999 ms", "TTFT p50", "TTFT p99",
                           "prefill saved", "errors"], align_right=range(1, 11)),
             "", "same-run baseline: the same clients and mix without the cache (recompute), before it",
             render_comparisons(r.comparisons(), "clients"), ""]
    for p in (r.recompute, r.cache):
        errors = ", ".join(f"{kind}: {n:,}" for kind, n in p.errors.items()) or "none"
        routes = ", ".join(f"{w} {n:,}" for w, n in p.routes.items()) or "none"
        sources = ", ".join(f"{t} {n:,}" for t, n in p.sources.items()) or "none"
        lines.append(f"{p.phase}: errors by kind: {errors}; requests per worker: {routes}; reused tokens by tier: "
                     f"{sources}")
    a = r.answers
    lines.append(f"answers compared with the recompute answer for their prompt: {a.answers_compared:,} over "
                 f"{a.prompts:,} distinct prompts ({a.recomputed:,} recomputed; {a.failed:,} recomputes failed): "
                 f"wrong answers: {a.wrong:,}")
    if r.tiers:
        lines.append(render_table([[name, format_binary(t["used_bytes"]), format_binary(t["capacity_bytes"]),
                                    f"{t['pages']:,}", f"{t['hits']:,}", f"{t['misses']:,}", f"{t['evictions']:,}"]
                                   for name, t in r.tiers.items()],
                                  ["cluster tier", "used", "capacity", "pages", "hits", "misses", "evictions"],
                                  align_right=range(1, 7)))
    if r.memory:
        limit = f"< {PLATEAU_GROWTH:.0%} or < {format_binary(PLATEAU_SLACK)}"
        lines += [f"RSS of each actor on this host during the mix (growth: the last third's median over the middle "
                  f"third's; plateau: {limit}; peak growth: the same for the largest samples)",
                  render_table([_memory_row(m) for m in r.memory], ["actor", "samples", "min", "max", "growth",
                                                                    "peak growth", "verdict"], align_right=range(1, 6))]
    else:
        lines.append("RSS: no shard or worker runs on this host")
    if r.png:
        lines.append(f"figure: {r.png}")
    return "\n".join(lines)
