"""Timing helpers shared by the benchmarks: best-of-N wall time, and a result row with its baseline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


def best_time(fn: Callable[[], Any], repeat: int = 5) -> float:
    """Smallest wall time of `repeat` calls, in seconds (the least disturbed by a noisy machine)."""
    return timed(fn, repeat)[0]


def timed(fn: Callable[[], Any], repeat: int = 5) -> tuple[float, Any]:
    """(smallest wall time of `repeat` calls, what the last call returned): the result shows what
    the timed call really did (`Comparison.work`)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (the nearest rank; 0 for none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def returned_bytes(result: Any) -> int:
    """Bytes a timed read returned: blobs (None for a miss counts 0), or a tensor."""
    if hasattr(result, "numel"):
        return int(result.numel() * result.element_size())
    return sum(len(b) for b in result if b is not None)


@dataclass(frozen=True)
class Comparison:
    """One measured figure beside a baseline measured in the same run."""

    scale: str
    operation: str
    value: float
    baseline_name: str
    baseline: float
    unit: str
    higher_is_better: bool
    # What the last timed call of each side really did (bytes returned or written, pages matched,
    # tokens keyed), read from its results: equal to what was asked unless the benchmark is broken.
    work: float | None = None
    baseline_work: float | None = None

    @property
    def ratio(self) -> float:
        """Speed relative to the baseline: above 1 the project is faster, below 1 slower."""
        fast, slow = (self.value, self.baseline) if self.higher_is_better else (self.baseline, self.value)
        return fast / slow if slow else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def render_comparisons(rows: list[Comparison], scale_header: str) -> str:
    from tiered_cache.report.table import render_table

    table = [[r.scale, r.operation, f"{r.value:,.2f} {r.unit}", r.baseline_name,
              f"{r.baseline:,.2f} {r.unit}", _ratio_text(r.ratio)] for r in rows]
    return render_table(table, [scale_header, "operation", "tiered-cache", "baseline", "baseline figure",
                                "speed vs baseline"], align_right=(2, 4, 5))


def _ratio_text(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"
