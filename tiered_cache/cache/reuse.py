"""Reuse policy: load a cached prefix only as far as it arrives sooner than the engine computes it.

On a GPU prefill is fast (a datacenter GPU prefills 8k tokens of an 8B model in a fraction of a
second), so pages from a slow tier (a store server at 1 GB/s, Redis over a slow link) can make
time to first token worse than recomputing them. The cache keeps moving estimates of what each tier costs and of the
engine's prefill rate, and `pages_to_load` cuts the plan where loading stops paying.

The cost model, for the pages past the device prefix, in order (`plan[i]`: HOST or a lower tier):

    load(k)      = sum(page_bytes / rate(plan[i]) for i < k) + sum(latency(t) for each tier t in plan[:k])
    recompute(k) = k * page_tokens / prefill_rate
    saved(k)     = recompute(k) - load(k)

Only a prefix cut is possible: attention needs the prefix contiguous, so pages after the cut are
recomputed whatever tier holds them, and the engine computes everything after the loaded prefix
anyway. `pages_to_load` returns the k in 0..len(plan) with the largest `saved(k)` (the largest k
on ties; `saved(0)` is 0). A fast host RAM run before a slow store run keeps the host pages; a
few slow pages between fast ones are loaded when the fast ones after them pay for them.

The estimates: `RateEstimator` fits `seconds = latency + amount / rate` to recent samples, each
sample weighing (1 - alpha) less per newer one. A latency is fitted only when the samples differ
enough in size to tell it from the rate (gRPC and Redis calls pay a fixed cost per call, which
makes a one-page load look many times slower per byte than a big one); otherwise it is 0 and the
rate is fitted through the origin (of one size: total amount over total seconds). Past the largest
amount measured that is a guess, and a pessimistic one (`Rate.known_up_to`: a first load of one
page, mostly round trip, prices many pages at many round trips): the request still recomputes them
(never slower than recompute on a guess), and the reuse policy gets those pages from the tier
aside at once, so the next plan knows it.
The prefill rate is estimated apart, robustly (`prefill_estimate.py`: medians over the last
forwards), since a busy spell or a short suffix must not move it far.

Until an estimate exists nothing is skipped: with no prefill rate every page is loaded, and a
tier never measured is taken as free, so it is loaded and measured.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiered_cache.cache.handle import HOST
from tiered_cache.cache.prefill_estimate import PrefillEstimate, PrefillFigure
from tiered_cache.config import ReusePolicy

if TYPE_CHECKING:
    from tiered_cache.config import CacheConfig
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.tiers.chain import TierChain

_ALPHA = 0.25  # weight of the newest sample: about the last 4-8 samples count
_MIN_SPREAD = 0.1  # samples' size spread (std / mean) needed before a latency is fitted

@dataclass(frozen=True)
class Rate:
    """A fitted cost: `latency_s` per call plus `amount / per_s` (bytes or tokens).

    `known_up_to`: the largest amount the fit saw, where no latency could be fitted (samples of
    one size; infinite where one was). Such a rate is fitted through the origin, latency
    included, so past `known_up_to` it may overstate what a bigger call costs: a first load of
    one page, mostly round trip, prices a hundred pages at a hundred round trips. `seconds` still
    prices them so (pessimistic: a request never waits for a load on a guess), and the reuse
    policy measures the bigger size aside (`ReuseGate._probe_skipped`)."""

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
        # Samples of one size, a bigger call no slower than a smaller one, or a negative latency
        # (noise gives these): no latency, so what a larger call costs is a guess
        # (Rate.known_up_to). The rate is fitted through the origin, where bigger calls weigh
        # more: a small call slowed once (connecting) does not price a fast bulk load as slow.
        # Of one size this is the mean rate.
        return Rate(self._xx / self._xy, known_up_to=self.largest)


@dataclass(frozen=True)
class ReuseStats:
    """What the reuse policy knows and did, for `stats()`: estimates and pages skipped."""

    policy: str
    prefill_tokens_per_s: float | None  # the rate planning uses (configured, else measured)
    prefill_configured: bool  # True: from CacheConfig.prefill_tokens_per_s, never learned
    load_rates: dict[str, Rate] = field(default_factory=dict)  # tier -> fitted load cost
    skipped_pages: dict[str, int] = field(default_factory=dict)  # tier -> pages left to recompute
    prefill_measured: PrefillFigure | None = None  # what a measured rate rests on (None: none yet)

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped_pages.values())

    def to_dict(self) -> dict[str, Any]:
        measured = self.prefill_measured
        return {"policy": self.policy, "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "prefill_configured": self.prefill_configured,
                "prefill_measured": None if measured is None else {
                    "tokens_per_s": measured.tokens_per_s, "forwards": measured.samples,
                    "throughput_tokens_per_s": measured.throughput, "basis": measured.basis},
                "load_rates": {t: {"bytes_per_s": r.per_s, "latency_s": r.latency_s,
                                   "known_up_to_bytes": None if math.isinf(r.known_up_to) else r.known_up_to}
                               for t, r in self.load_rates.items()},
                "skipped_pages": dict(self.skipped_pages)}


class ReuseEstimates:
    """The estimates one cache plans with: a load rate per tier (bytes/s, by tier name) and the
    engine's prefill rate (tokens/s). Thread-safe: samples arrive from prefetch threads."""

    def __init__(self, policy: ReusePolicy = ReusePolicy.FASTER, prefill_tokens_per_s: float | None = None) -> None:
        self.policy = policy
        self._configured_prefill = prefill_tokens_per_s
        self._lock = threading.Lock()
        self._loads: dict[str, RateEstimator] = {}
        self._prefill = PrefillEstimate()
        self._skipped: Counter[str] = Counter()
        self._probed: dict[str, float] = {}  # tier -> when a re-measuring probe last started

    # --- samples ---------------------------------------------------------------------------------
    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load into the pool (`TierLoads`' loads: host RAM -> pool, or a whole load from one tier)."""
        with self._lock:
            self._loads.setdefault(tier, RateEstimator()).add(nbytes, seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        with self._lock:
            self._prefill.add(num_tokens, seconds)

    # --- estimates -------------------------------------------------------------------------------
    def load_rate(self, tier: str) -> Rate | None:
        with self._lock:
            estimator = self._loads.get(tier)
            return estimator.estimate() if estimator is not None else None

    def prefill_rate(self) -> float | None:
        """Tokens per second of prefill: the configured figure, else the measured one, else None."""
        if self._configured_prefill is not None:
            return self._configured_prefill
        with self._lock:
            figure = self._prefill.figure()
        return figure.tokens_per_s if figure is not None else None

    def cut(self, plan: Sequence[int], names: Mapping[int, str], page_bytes: int, page_tokens: int) -> int:
        """How many leading pages of `plan` to load under this policy (`names`: plan entry -> tier
        name). ALWAYS: all of them."""
        if self.policy is ReusePolicy.ALWAYS:
            return len(plan)
        rates = {where: self.load_rate(name) for where, name in names.items()}
        return pages_to_load(plan, rates, page_bytes, page_tokens, self.prefill_rate())

    def count_skipped(self, tiers: Sequence[str]) -> None:
        """Pages (by the tier that held each) left for the engine to recompute."""
        with self._lock:
            self._skipped.update(tiers)

    def due_for_probe(self, tier: str, after_s: float, since_sample: bool = True) -> bool:
        """Whether the skipped `tier`'s estimate is older than `after_s` (with `since_sample`) and
        no probe started in that time: a tier judged slow is never loaded, so nothing else would
        ever re-measure it (a slow first load, a link that recovered). Marks the probe as started."""
        now = time.monotonic()
        with self._lock:
            estimator = self._loads.get(tier)
            measured = estimator.last_at if estimator is not None and estimator.last_at is not None else 0.0
            last = max(measured if since_sample else 0.0, self._probed.get(tier, 0.0))
            if now - last < after_s:
                return False
            self._probed[tier] = now
            return True

    def stats(self) -> ReuseStats:
        prefill = self.prefill_rate()
        with self._lock:
            rates = {t: fit for t, e in self._loads.items() if (fit := e.estimate()) is not None}
            skipped = dict(self._skipped)
            measured = self._prefill.figure()
        return ReuseStats(self.policy.value, prefill, self._configured_prefill is not None, rates, skipped, measured)


def pages_to_load(plan: Sequence[int], rates: Mapping[int, Rate | None], page_bytes: int, page_tokens: int,
                  prefill_tokens_per_s: float | None) -> int:
    """How many leading pages of `plan` to load: the cut that saves the most time (module doc).

    `plan[i]` says where page i lives (HOST or a lower tier index, as in `CacheHandle.plan`);
    `rates` maps those entries to a fitted load cost in bytes (missing or None: not measured
    yet, taken as free so the tier gets loaded and measured). With no prefill rate, everything
    is loaded. Pure: no clock, no state.
    """
    if prefill_tokens_per_s is None or not plan:
        return len(plan)
    assert prefill_tokens_per_s > 0 and page_bytes > 0 and page_tokens > 0
    compute_page = page_tokens / prefill_tokens_per_s
    best, best_saved, spent = 0, 0.0, 0.0
    used: set[int] = set()
    for i, where in enumerate(plan):
        rate = rates.get(where)
        if rate is not None:
            spent += page_bytes / rate.per_s
            if where not in used:  # one batched call per tier: its latency is paid once
                used.add(where)
                spent += rate.latency_s
        saved = (i + 1) * compute_page - spent
        if saved >= best_saved:
            best, best_saved = i + 1, saved
    return best


# A lower tier skipped as slower than recompute is re-measured (a background get of up to
# _PROBE_PAGES of the pages skipped) once its estimate is this old; at once (one probe a second at
# most) where the estimate priced more than it has seen (`Rate.extrapolates`), with enough of the
# skipped pages to see a larger size.
REUSE_REMEASURE_S = 30.0
REUSE_EXTRAPOLATED_PROBE_S = 1.0
_PROBE_PAGES = 8


class ReuseGate:
    """The reuse policy of one cache: its estimates, fed by every load into the pool and every
    batched get below (the gets of mixed loads included), and the cut of each plan where loading stops
    paying; a tier skipped as slow is re-measured in the background (`_probe_skipped`)."""

    def __init__(self, config: CacheConfig, chain: TierChain, tier_name: Callable[[int], str], spec: KVSpec) -> None:
        self.estimates = ReuseEstimates(config.reuse, config.prefill_tokens_per_s)
        self.chain = chain
        self.tier_name = tier_name  # a plan entry's tier (`CacheCore.tier_name`)
        self.page_bytes, self.page_tokens = spec.bytes_per_page, spec.page_size
        self._probing: set[str] = set()  # lower tiers with a re-measuring probe running
        self._probe_lock = threading.Lock()
        chain.observe_gets(self.observe, pages=True)

    def observe(self, tier: str, seconds: float, pages: int) -> None:
        """`pages` loaded from `tier` in `seconds` (also a `TierChain` get observer): in page
        bytes, as plans count them (a compressed blob is smaller, yet spares a whole page)."""
        if pages:
            self.estimates.observe_load(tier, pages * self.page_bytes, seconds)

    def cut(self, plan: list[int]) -> int:
        """How many leading pages of `plan` to load under the reuse policy."""
        names = {where: self.tier_name(where) for where in set(plan)}
        return self.estimates.cut(plan, names, self.page_bytes, self.page_tokens)

    def worth_loading(self, keys: Sequence[bytes], plan: list[int]) -> list[int]:
        """The leading part of `plan` (for `keys`) worth loading: the pages cut off are counted
        per tier, and a lower tier among them whose estimate is stale is re-measured."""
        keep = self.cut(plan)
        if keep < len(plan):  # the rest arrives later than the engine would compute it
            self.estimates.count_skipped([self.tier_name(where) for where in plan[keep:]])
            self._probe_skipped(list(keys[keep:len(plan)]), plan[keep:])
        return plan[:keep]

    def _probe_skipped(self, keys: list[bytes], plan: list[int]) -> None:
        """Re-measure lower tiers skipped as slow whose estimate is `REUSE_REMEASURE_S` old, or
        that priced the skipped pages past what they have seen: a skipped tier is never loaded
        from, so nothing else would ever update it (a first load slowed by connecting, a link
        that recovered). Some of the skipped pages are read from it in the background
        (`TierChain.get`) and thrown away; the get observers take the sample. Host RAM is not probed: its copies run at
        memory speed, which does not drift the way a network does."""
        for index in sorted(set(plan) - {HOST}):
            tier = self.chain.tiers[index].name
            if tier in self._probing:  # one probe a tier at a time: a slow link's probe takes seconds
                continue
            skipped = [k for k, where in zip(keys, plan, strict=True) if where == index]
            rate = self.estimates.load_rate(tier)
            size = len(skipped) * self.page_bytes
            if rate is not None and rate.extrapolates(size):
                # Judged on smaller loads only (a one-page first load is mostly its round trip):
                # measure this size now rather than skip the tier for REUSE_REMEASURE_S on a guess.
                if not self.estimates.due_for_probe(tier, REUSE_EXTRAPOLATED_PROBE_S, since_sample=False):
                    continue
                count = max(_PROBE_PAGES, 2 * math.ceil(rate.known_up_to / self.page_bytes))
            elif self.estimates.due_for_probe(tier, REUSE_REMEASURE_S):
                count = _PROBE_PAGES
            else:
                continue
            chosen = skipped[:count]
            with self._probe_lock:
                if tier in self._probing:
                    continue
                self._probing.add(tier)

            def probe(chosen: list[bytes] = chosen, index: int = index, tier: str = tier) -> None:
                try:
                    with contextlib.suppress(Exception):  # a tier closed meanwhile: nothing to learn
                        self.chain.get(chosen, [index] * len(chosen))
                finally:
                    with self._probe_lock:
                        self._probing.discard(tier)

            threading.Thread(target=probe, name=f"tiered-cache-probe-{tier}", daemon=True).start()
