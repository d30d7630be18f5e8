"""What `bench serve` prints: per way, TTFT and end-to-end latency (p50, p99), output tokens and
requests a second, the share of prompt tokens served from a cache, errors, and how many answers
equal the first way's; what our router counted in a way it routed (`router_lines`: fallbacks,
holds, the rates it learned); and, asked for, every request's outcome per way (`outcomes`), to
see which requests a way lost its time on."""

from __future__ import annotations

from typing import Any

from tiered_cache.bench.serve.runner import WayRun
from tiered_cache.bench.serve.workload import ServeRequest
from tiered_cache.bench.timing import quantile
from tiered_cache.report.table import render_table


def summary(run: WayRun, baseline: WayRun | None) -> dict[str, Any]:
    """A way's figures (our router's stats under `router`, where it routed)."""
    ok = [o for o in run.outcomes if not o.error]
    prompt = sum(o.prompt_tokens for o in ok)
    same = compared = 0
    if baseline is not None:
        theirs = {o.key: o.text for o in baseline.outcomes if not o.error}
        for o in ok:
            if o.key in theirs:
                compared += 1
                same += o.text == theirs[o.key]
    return {"way": run.way, "requests": len(run.outcomes), "errors": len(run.outcomes) - len(ok),
            "ttft_p50_s": quantile([o.ttft_s for o in ok], 0.5), "ttft_p99_s": quantile([o.ttft_s for o in ok], 0.99),
            "e2e_p50_s": quantile([o.latency_s for o in ok], 0.5),
            "e2e_p99_s": quantile([o.latency_s for o in ok], 0.99),
            "output_tokens_per_s": sum(o.output_tokens for o in ok) / run.wall_s if run.wall_s else 0.0,
            "requests_per_s": len(ok) / run.wall_s if run.wall_s else 0.0,
            "prompt_tokens": prompt, "cached_tokens": sum(o.cached_tokens for o in ok),
            "cached_share": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
            "answers_compared": compared, "answers_equal": same,
            **({"router": run.router} if run.router else {})}


def render(rows: list[dict[str, Any]]) -> str:
    best = rows[0]
    table = [[r["way"], f"{r['ttft_p50_s'] * 1e3:,.0f}", f"{r['ttft_p99_s'] * 1e3:,.0f}",
              f"{best['ttft_p50_s'] / r['ttft_p50_s']:.2f}x" if r["ttft_p50_s"] else "-",
              f"{r['e2e_p50_s'] * 1e3:,.0f}", f"{r['e2e_p99_s'] * 1e3:,.0f}", f"{r['output_tokens_per_s']:.1f}",
              f"{r['requests_per_s']:.2f}", f"{r['cached_share']:.0%}", str(r["errors"]),
              f"{r['answers_equal']}/{r['answers_compared']}" if r["answers_compared"] else "-"]
             for r in rows]
    return render_table(table, ["way", "TTFT p50 ms", "p99 ms", "p50 vs first", "e2e p50 ms", "p99 ms", "out tok/s",
                                "req/s", "cached", "errors", "answers = first"])


def router_lines(runs: list[WayRun]) -> list[str]:
    """A line for each way our router routed: its routes per replica, fallbacks (decided by the
    prefix policy: events not followed yet or stale), requests held for the store and holds
    that expired, decisions that passed over a replica with as many requests as it takes and
    requests Serve asked for again (refused, or their replica died), and the rates it learned by
    the end."""
    lines = []
    for run in runs:
        if not run.router:
            continue
        r, rates = run.router, run.router.get("estimate") or {}
        routed = " / ".join(str(n) for _, n in sorted((r.get("routed") or {}).items()))
        lines.append(f"{run.way}: routed {routed or 0} per replica; {r.get('fallbacks', 0)} by the fallback; "
                     f"{r.get('holds', 0)} held for the store ({r.get('expired_holds', 0)} expired); "
                     f"{r.get('full_passed', 0)} passed a full replica over, {r.get('asked_again', 0)} asked for "
                     f"again; learned "
                     f"from {rates.get('samples', 0)} answers: prefill {rates.get('prefill_s_per_token', 0) * 1e3:.2f} "
                     f"ms/token, a cached token {rates.get('cached_share', 0):.0%} of it, store "
                     f"{rates.get('store_s_per_token', 0) * 1e6:.0f} us/token "
                     f"({'as the replicas timed their loads' if rates.get('store_timed') else 'from TTFTs'})")
    return lines


def outcomes(runs: list[WayRun], requests: list[ServeRequest]) -> dict[str, list[dict[str, Any]]]:
    """Per way, each request in arrival order: its key, arrival, TTFT, latency, prompt and cached
    tokens, output tokens, error and our router's route (empty where another router chose; the
    same keys in every way, so rows line up)."""
    arrival = {r.key: r.arrival_s for r in requests}
    return {run.way: sorted(({"key": o.key, "arrival_s": arrival.get(o.key), "ttft_s": o.ttft_s,
                              "latency_s": o.latency_s, "prompt_tokens": o.prompt_tokens,
                              "cached_tokens": o.cached_tokens, "output_tokens": o.output_tokens,
                              "error": o.error, "route": o.route} for o in run.outcomes),
                            key=lambda row: (row["arrival_s"] is None, row["arrival_s"] or 0.0))
            for run in runs}
