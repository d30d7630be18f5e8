"""Timing helpers shared by the benchmarks: best-of-N wall time, and a result row with its baseline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


def best_time(fn: Callable[[], Any], repeat: int = 5) -> float:
    """Smallest wall time of `repeat` calls, in seconds (the least disturbed by a noisy machine)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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

    @property
    def ratio(self) -> float:
        """Speed relative to the baseline: above 1 the project is faster, below 1 slower."""
        fast, slow = (self.value, self.baseline) if self.higher_is_better else (self.baseline, self.value)
        return fast / slow if slow else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def render_comparisons(rows: list[Comparison], scale_header: str) -> str:
    from tiered_cache.cli.table import render_table

    table = [[r.scale, r.operation, f"{r.value:,.2f} {r.unit}", r.baseline_name,
              f"{r.baseline:,.2f} {r.unit}", _ratio_text(r.ratio)] for r in rows]
    return render_table(table, [scale_header, "operation", "tiered-cache", "baseline", "baseline figure",
                                "speed vs baseline"], align_right=(2, 4, 5))


def _ratio_text(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"
