"""`bench store-traffic --ray`'s printed report: each phase's figures, the comparison with recompute, the
answer check, the cluster's tiers, and each actor's memory with its plateau verdict."""

from __future__ import annotations

from tiered_cache.bench.store_traffic.report import PhaseFigures, ProcessMemory, RayTrafficResult
from tiered_cache.bench.store_traffic.rss import PLATEAU_GROWTH, PLATEAU_SLACK
from tiered_cache.bench.timing import render_comparisons
from tiered_cache.model.units import format_binary
from tiered_cache.report.table import render_table


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


def render_ray_traffic(result: RayTrafficResult) -> str:
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
