"""`PrefillEstimate`: the engine's prefill rate (tokens/s), learned from its forwards, robust to noise.

Each sample is one forward over `tokens` new tokens that took `seconds`. Samples lie: on a busy
machine one forward takes many times longer (another process had the cores), a short suffix is
mostly a forward's fixed cost, and a few similar sizes make any fitted slope noise. The reuse
policy decides from this figure whether a load beats recomputing, so it must not wander with them.

Noise on a machine is one-sided: a forward is slowed (other work, a page fault, a preemption),
almost never sped up. So over the last `WINDOW` samples the figure rests on the upper quartile of
their throughputs (tokens / seconds): it stays in place while up to three in four forwards are
slowed and one in four reads fast by a timer's luck, and it counts a forward's fixed cost as
prefill (erring towards loading). Where the sizes spread enough to tell a slope from that fixed
cost, the Theil-Sen slope (the median of the pairwise slopes) gives the rate instead, held between
that throughput and `SLOPE_CAP` times it (a slope between noisy samples can claim any speed).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

WINDOW = 16  # the forwards remembered: the newest count, a busy spell passes
SLOPE_CAP = 4.0  # a slope's rate at most this many times the median throughput
MIN_SPREAD_TOKENS = 512.0  # sizes' std below which no slope is fitted (similar suffixes)


@dataclass(frozen=True)
class PrefillFigure:
    """What the estimate plans with, and what it rests on (for `stats`)."""

    tokens_per_s: float
    samples: int  # forwards in the window
    throughput: float  # tokens/s: the upper quartile of their throughputs
    basis: str  # "slope" (Theil-Sen, fixed cost left out) or "throughput" (the upper quartile)


class PrefillEstimate:
    """Not thread-safe: `ReuseEstimates` locks around it."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._figure: PrefillFigure | None = None  # kept until the next sample: every match plans with it

    def add(self, tokens: float, seconds: float) -> None:
        """One forward; empty or instant ones say nothing and are ignored."""
        if tokens > 0 and seconds > 0 and tokens < float("inf") and seconds < float("inf"):
            self._samples.append((float(tokens), float(seconds)))
            self._figure = None

    def figure(self) -> PrefillFigure | None:
        """The current estimate, or None before any sample."""
        if self._figure is None and self._samples:
            self._figure = self._fit()
        return self._figure

    def _fit(self) -> PrefillFigure:
        throughputs = [t / s for t, s in self._samples]
        typical = statistics.quantiles(throughputs, n=4)[2] if len(throughputs) > 1 else throughputs[0]
        slope = self._slope()
        if slope is not None and slope > 0:
            rate = min(max(1.0 / slope, typical), SLOPE_CAP * typical)
            return PrefillFigure(rate, len(self._samples), typical, "slope")
        return PrefillFigure(typical, len(self._samples), typical, "throughput")

    def _slope(self) -> float | None:
        """Seconds per extra token, Theil-Sen over the window; None when the sizes are too alike."""
        points = list(self._samples)
        if len(points) < 3 or statistics.pstdev(t for t, _ in points) < MIN_SPREAD_TOKENS:
            return None
        slopes = [(s2 - s1) / (t2 - t1) for i, (t1, s1) in enumerate(points) for t2, s2 in points[i + 1:]
                  if abs(t2 - t1) >= MIN_SPREAD_TOKENS / 4]
        return statistics.median(slopes) if slopes else None
