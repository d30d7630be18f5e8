"""`bench load`'s figures from the clients' reports: calls/s and p50/p99/p999 per operation beside
the same-run baseline, errors by kind, pages checked, and the server's memory over the run."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tiered_cache.bench.load_client import OPS, ClientReport, Timeline
from tiered_cache.bench.load_rss import Plateau, plateau
from tiered_cache.bench.timing import Comparison


@dataclass(frozen=True)
class OpFigures:
    op: str
    calls: int
    per_s: float
    p50_ms: float
    p99_ms: float
    p999_ms: float


@dataclass(frozen=True)
class TierFigures:
    name: str
    used: int
    capacity: int
    pages: int
    evictions: int


@dataclass(frozen=True)
class LoadResult:
    clients: int
    window_s: float  # the mix: first release to the last call's end
    requests: int
    ops: list[OpFigures]
    baseline: OpFigures  # 1-key Lookups, as many client processes, store idle
    errors: dict[str, int]
    pages_compared: int
    pages_missing: int
    pages_put: int
    distinct_pages: int
    blob_bytes: int
    rss: list[tuple[float, int]]  # (s since the mix began, bytes)
    plateau: Plateau | None
    tiers: list[TierFigures]  # the server's, after the run
    png: str | None

    @property
    def wrong_bytes(self) -> int:
        return self.errors.get("wrong_bytes", 0)

    def comparisons(self) -> list[Comparison]:
        scale = f"{self.clients} client{'s' if self.clients > 1 else ''}"
        base = self.baseline
        rows = [Comparison(scale, "calls/s, all operations", sum(o.per_s for o in self.ops),
                           "1-key Lookups/s", base.per_s, "calls/s", True)]
        for op in self.ops:
            for q in ("p50", "p99", "p999"):
                rows.append(Comparison(scale, f"{op.op} {q}", getattr(op, f"{q}_ms"), f"1-key Lookup {q}",
                                       getattr(base, f"{q}_ms"), "ms", False))
        return rows

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["plateau"] = self.plateau.to_dict() if self.plateau else None
        out["wrong_bytes"] = self.wrong_bytes
        out["comparisons"] = [r.to_dict() for r in self.comparisons()]
        return out


def percentiles(values: np.ndarray) -> tuple[float, float, float]:
    """p50, p99 and p999 of `values` (NaN when there are none)."""
    if not len(values):
        return float("nan"), float("nan"), float("nan")
    p50, p99, p999 = np.percentile(values, [50, 99, 99.9])
    return float(p50), float(p99), float(p999)


def figures(op: str, timelines: list[Timeline], window_s: float) -> OpFigures:
    latencies = np.concatenate([np.frombuffer(t.latencies) for t in timelines]) * 1e3
    return OpFigures(op, len(latencies), len(latencies) / window_s, *percentiles(latencies))


def summarise(reports: list[ClientReport], rss: list[tuple[float, int]], prompt_pages: int, blob_bytes: int,
              tiers: list[TierFigures], png: str | None) -> LoadResult:
    """Merge the clients' reports; `rss` in time.monotonic seconds (made relative to the mix's start)."""
    start, end = min(r.window[0] for r in reports), max(r.window[1] for r in reports)
    b_start, b_end = min(r.baseline_window[0] for r in reports), max(r.baseline_window[1] for r in reports)
    errors: Counter = Counter()
    for r in reports:
        errors.update(r.errors)
    return LoadResult(
        clients=len(reports), window_s=end - start, requests=sum(r.requests for r in reports),
        ops=[figures(op, [r.ops[op] for r in reports], end - start) for op in OPS],
        baseline=figures("1-key lookup", [r.baseline for r in reports], b_end - b_start),
        errors=dict(sorted(errors.items())), pages_compared=sum(r.pages_compared for r in reports),
        pages_missing=sum(r.pages_missing for r in reports), pages_put=sum(r.pages_put for r in reports),
        distinct_pages=prompt_pages + sum(r.new_pages for r in reports), blob_bytes=blob_bytes,
        rss=[(t - start, b) for t, b in rss], plateau=plateau(rss, start, end), tiers=tiers, png=png)
