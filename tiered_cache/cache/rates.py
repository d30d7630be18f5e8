"""Moving estimates of what a tier's loads and the engine's prefills cost: `Rate` (latency plus
amount over a rate) and `RateEstimator` (an exponentially weighted fit of it), for the reuse
policy (`reuse.py`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

_ALPHA = 0.25  # weight of the newest sample: about the last 4-8 samples count
_MIN_SPREAD = 0.1  # samples' size spread (std / mean) needed before a latency is fitted

@dataclass(frozen=True)
class Rate:
    """A fitted cost: `latency_s` per call plus `amount / per_s` (bytes or tokens).

    `known_up_to`: the largest amount the fit saw, where no latency could be fitted (samples of
    one size; infinite where one was). Such a rate is total amount over total seconds, latency
    included, so past `known_up_to` it may overstate what a bigger call costs: a first fetch of
    one page, mostly round trip, prices a hundred pages at a hundred round trips. `seconds` still
    prices them so (pessimistic: a request never waits for a load on a guess), and the reuse
    policy measures the bigger size aside (`Promoter._probe_skipped`)."""

    per_s: float
    latency_s: float = 0.0
    known_up_to: float = math.inf

    def seconds(self, amount: float) -> float:
        return self.latency_s + amount / self.per_s

    def extrapolates(self, amount: float) -> bool:
        """Whether pricing `amount` goes past what the fit has seen (see `known_up_to`)."""
        return amount > self.known_up_to


class RateEstimator:
    """A moving fit of `seconds = latency + amount / rate` over (amount, seconds) samples, newer
    ones weighing more (exponentially). Not thread-safe: `ReuseEstimates` locks around it."""

    def __init__(self, alpha: float = _ALPHA) -> None:
        assert 0 < alpha <= 1
        self.alpha = alpha
        self.samples = 0
        self.largest = 0.0  # the largest amount of recent samples: how far a fit with no latency is known
        self.last_at: float | None = None  # time.monotonic() of the newest sample
        # Exponentially weighted sums: weight, x, y, x*x, x*y.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, amount: float, seconds: float) -> None:
        """One observation: `amount` (bytes, tokens) took `seconds`. Empty or instant ones are
        ignored (they say nothing about a rate)."""
        if not (amount > 0 and seconds > 0 and math.isfinite(amount) and math.isfinite(seconds)):
            return
        keep = 1.0 - self.alpha
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + amount
        self._y = self._y * keep + seconds
        self._xx = self._xx * keep + amount * amount
        self._xy = self._xy * keep + amount * seconds
        self.samples += 1
        # Fades as the sums do: a large load many samples ago no longer vouches for the fit.
        self.largest = max(amount, self.largest * keep)
        self.last_at = time.monotonic()

    def estimate(self, min_spread: float = 0.0) -> Rate | None:
        """The current fit, or None before any sample. A latency (and the rate as the slope) is
        fitted only when the samples' sizes spread by more than `_MIN_SPREAD` of their mean and
        by more than `min_spread` (std, in the samples' unit)."""
        if not self.samples:
            return None
        mx, my = self._x / self._w, self._y / self._w
        vx = self._xx / self._w - mx * mx
        cov = self._xy / self._w - mx * my
        if vx > max(_MIN_SPREAD * mx, min_spread) ** 2 and cov > 0:
            slope = cov / vx
            latency = my - slope * mx
            if latency >= 0:
                return Rate(1.0 / slope, latency)
        # Samples of one size (or a fit with a negative latency, which noise gives): no latency,
        # so what a larger call costs is a guess (Rate.known_up_to).
        return Rate(mx / my, known_up_to=self.largest)
