"""The table of `tiered-cache bench gpu` (columns: docs/PERFORMANCE.md, "bench gpu")."""

from __future__ import annotations

import statistics
from typing import Any

from tiered_cache.bench.gpu_rows import GpuRow, describe_arena

HEADERS = ["tokens", "row", "TTFT p50", "min-max", "max/p50", "first", "speed-up", "reused from", "pool full",
           "load", "load GB/s", "limit GB/s", "load/limit", "max|dlogit|", "greedy"]


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _reused(row: GpuRow) -> str:
    if row.tier is None:
        return "-"
    if all(r == row.tokens for r in row.reused_tokens) and all(s == {row.tier: row.tokens} for s in row.sources):
        return f"{row.tokens:,} {row.tier}"
    return "UNEXPECTED (see below)"


def _greedy(row: GpuRow) -> str:
    if row.greedy_agrees is None:
        return "reference"
    return "same" if row.greedy_agrees else f"flipped (top-2 gap {row.margin:.3g})"


def _cells(row: GpuRow) -> list[str]:
    load = row.load_gbps
    moves = bool(row.load_s) and load is not None
    return [
        f"{row.tokens:,}", row.row, f"{_ms(row.p50_s)} ms", f"{_ms(min(row.ttft_s))}-{_ms(max(row.ttft_s))} ms",
        f"{max(row.ttft_s) / row.p50_s:.2f}", f"{_ms(row.first_s)} ms" if row.first_s is not None else "-",
        f"{row.speedup:.2f}x" if row.speedup else "-", _reused(row),
        f"{min(row.pool_full):.0%}-{max(row.pool_full):.0%}" if row.pool_full else "-",
        f"{_ms(statistics.median(row.load_s))} ms" if row.load_s else "-",
        f"{load:.2f}" if moves else ("no copy" if row.load_s else "-"),
        f"{row.limit_gbps:.2f}" if moves and row.limit_gbps else "-",
        f"{row.ratio:.2f}x" if moves and row.ratio else "-",
        f"{row.max_abs_diff:.3g}" if row.max_abs_diff is not None else "-", _greedy(row),
    ]


def _state(setup: dict[str, Any]) -> str:
    if setup.get("state", "warm") == "warm":
        return "from the same state (warm: one prefix, put back in its tier each round, a pool with room)"
    return (f"in the serving state: each round a prefix the reading cache never read, into a pool of "
            f"{setup['pool_prefixes']} prefixes kept full")


def render(setup: dict[str, Any], rows: list[GpuRow]) -> str:
    from tiered_cache.model.units import format_binary
    from tiered_cache.report.table import render_table

    layers = f"{setup['layers']} of {setup['total_layers']} layers"
    limit = next((r.limit_name for r in rows if r.limit_name), "copy")
    head = (f"{setup['model']}, random weights ({layers}), {setup['dtype']} on {setup['device']}; KV "
            f"{format_binary(setup['bytes_per_token'])}/token in pages of {setup['page_size']} tokens; prompt = prefix "
            f"+ {setup['suffix_tokens']} tokens; per row 1 unmeasured round (its TTFT: first), then "
            f"{setup['rounds']} {_state(setup)}.\nload = match + prefetch + load within that TTFT; "
            f"limit = {limit} of the same bytes, fastest of "
            f"{max(3, setup['rounds'])}; speed-up = recompute TTFT p50 / row TTFT p50; max|dlogit| = first-token "
            f"logits vs recompute's; pool full = its pages in use as the loads began."
            + (f"\nChecks: {setup['checks']}." if setup.get("checks") else ""))
    table = render_table([_cells(r) for r in rows], HEADERS, align_right=(0, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13))
    demotions = [f"demotion at {r.tokens:,} tokens (evict: device -> host RAM, every page copied): "
                 f"{r.evict_gbps:.2f} GB/s, {'pinned device->host copy' if 'pinned' in limit else 'memcpy'} "
                 f"{r.evict_limit_gbps:.2f} GB/s, {r.evict_gbps / r.evict_limit_gbps:.2f}x"
                 for r in rows if r.evict_gbps and r.evict_limit_gbps]
    arena = [f"{r.row} at {r.tokens:,} tokens, last round: {describe_arena(r.arena[-1], setup['bytes_per_page'])}"
             for r in rows if r.arena]
    odd = [f"!! {r.row} at {r.tokens:,}: reused {r.reused_tokens} tokens from {r.sources}, expected {r.tokens:,} "
           f"from {r.tier} every round" for r in rows if r.tier is not None and _reused(r).startswith("UNEXPECTED")]
    return "\n".join([head, table, *demotions, *arena, *odd])
