"""The correctness canary: a sample of cache hits recomputed off the request path and compared
with the KV that was reused.

Checksums prove a page is the bytes that were stored, not that those bytes are the KV of the
tokens it is keyed by: a tier that lies (a buggy peer, a store restored from the wrong backup, a
client that put another prompt's KV under these keys) passes every checksum. An integration
that has the model (`integrations/transformers.py`) hands the canary one hit in
`1 / verify_fraction`; on a background thread (one job at a time: a hit that finds it busy is
not checked, counted as dropped) the prompt's prefix is recomputed and each reused page compared
with it. A page that differs beyond what recomputation noise explains is a mismatch: counted,
logged once per (namespace, tier) with its keys, its keys never reused again in this process
(`poisoned`), and the tier it came from quarantined for that namespace: `match` no longer loads
from it until an operator calls `clear()`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_log = logging.getLogger(__name__)
# A page differs when its largest difference from recomputation exceeds this share of the page's
# largest value: far above what storage (fp16/bf16/int8) and kernel order add (~1e-3 to 1e-2),
# far below what KV of other tokens is off by (the order of the values themselves).
TOLERANCE = 0.1
MAX_POISONED = 1 << 20  # keys remembered as wrong; past it the oldest are forgotten (and quarantine stays)


@dataclass(frozen=True)
class CanaryStats:
    fraction: float
    checks: int = 0  # hits compared with recomputation
    mismatches: int = 0  # of which some page differed
    dropped: int = 0  # hits due a check that found the canary busy
    pages_checked: int = 0
    pages_wrong: int = 0
    quarantined: dict[str, list[str]] = field(default_factory=dict)  # namespace -> tiers not loaded from

    def to_dict(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "checks": self.checks, "mismatches": self.mismatches,
                "dropped": self.dropped, "pages_checked": self.pages_checked, "pages_wrong": self.pages_wrong,
                "quarantined": {ns: list(tiers) for ns, tiers in self.quarantined.items()}}


def pages_differ(reused: torch.Tensor, fresh: torch.Tensor, page_size: int,
                 tolerance: float = TOLERANCE) -> list[bool]:
    """Per page of `page_size` tokens, whether `reused` KV (layers, 2, tokens, heads, dim) differs
    from `fresh` (the same shape, recomputed) by more than `tolerance` of the page's scale."""
    if reused.shape != fresh.shape:
        raise ValueError(f"reused KV {tuple(reused.shape)} and recomputed {tuple(fresh.shape)} differ in shape")
    pages = reused.shape[2] // page_size
    a = reused[:, :, :pages * page_size].float().unflatten(2, (pages, page_size)).transpose(0, 2)
    b = fresh[:, :, :pages * page_size].float().unflatten(2, (pages, page_size)).transpose(0, 2)
    error = (a - b).abs().flatten(1).amax(dim=1)
    scale = b.abs().flatten(1).amax(dim=1).clamp_min(1e-6)
    return (error > tolerance * scale).tolist()


class Canary:
    def __init__(self, fraction: float = 0.0) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"verify_fraction must be between 0 and 1, got {fraction}")
        self.fraction = fraction
        self._lock = threading.Lock()
        self._hits = 0
        self._checks = self._mismatches = self._dropped = self._pages_checked = self._pages_wrong = 0
        self._quarantine: dict[str, set[str]] = {}
        self._poisoned: dict[bytes, None] = {}  # insertion-ordered: the oldest forgotten first
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=1)
        self._busy = 0  # jobs queued or running
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    # --- sampling and jobs ------------------------------------------------------------------------
    def due(self) -> bool:
        """Whether this hit is one to check: one in `1 / fraction`, evenly (the first hit is not)."""
        if self.fraction <= 0:
            return False
        with self._lock:
            self._hits += 1
            return int(self._hits * self.fraction) > int((self._hits - 1) * self.fraction)

    def submit(self, job: Callable[[], None]) -> bool:
        """Run `job` on the canary's thread; False (counted as dropped) when one is queued already."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered-cache-canary", daemon=True)
                self._thread.start()
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                self._dropped += 1
                return False
            self._busy += 1
            return True

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a check that failed to run says nothing about the cache
                _log.exception("tiered-cache canary: a check failed to run")
            finally:
                with self._lock:
                    self._busy -= 1
                    self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no check is queued or running; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    # --- verdicts ---------------------------------------------------------------------------------
    def record(self, namespace: str, keys: Sequence[bytes], tiers: Sequence[str], wrong: Sequence[bool]) -> None:
        """The verdict of one check: per reused page its key, the tier it came from and whether it
        differed from recomputation."""
        bad = [(key, tier) for key, tier, w in zip(keys, tiers, wrong, strict=True) if w]
        with self._lock:
            self._checks += 1
            self._pages_checked += len(keys)
            self._pages_wrong += len(bad)
            if not bad:
                return
            self._mismatches += 1
            for key, _ in bad:
                self._poisoned[key] = None
            while len(self._poisoned) > MAX_POISONED:
                del self._poisoned[next(iter(self._poisoned))]
            by_tier: dict[str, list[bytes]] = {}
            for key, tier in bad:
                by_tier.setdefault(tier, []).append(key)
            quarantined = self._quarantine.setdefault(namespace, set())
            fresh = [(tier, tier_keys) for tier, tier_keys in by_tier.items() if tier not in quarantined]
            quarantined.update(by_tier)
        for tier, tier_keys in fresh:
            _log.error("tiered-cache canary: %d reused page(s) from tier %r in namespace %r differ from "
                       "recomputation (keys %s%s); tier %r quarantined for this namespace until cleared",
                       len(tier_keys), tier, namespace, ", ".join(k.hex()[:16] for k in tier_keys[:4]),
                       ", ..." if len(tier_keys) > 4 else "", tier)

    def quarantined(self, namespace: str) -> frozenset[str]:
        """The tiers `match` does not load from for `namespace`."""
        with self._lock:
            return frozenset(self._quarantine.get(namespace, ()))

    def first_poisoned(self, keys: Sequence[bytes]) -> int:
        """Index of the first of `keys` found wrong by a check (len(keys) when none was)."""
        if not self._poisoned:
            return len(keys)
        return next((i for i, key in enumerate(keys) if key in self._poisoned), len(keys))

    def clear(self, namespace: str | None = None, tier: str | None = None) -> None:
        """Lift the quarantine (of one namespace and/or tier; all by default). Keys found wrong stay
        unused: their pages may still be held anywhere."""
        with self._lock:
            for ns in [namespace] if namespace is not None else list(self._quarantine):
                tiers = self._quarantine.get(ns, set())
                tiers.difference_update([tier] if tier is not None else list(tiers))
                if not tiers:
                    self._quarantine.pop(ns, None)

    def stats(self) -> CanaryStats:
        with self._lock:
            return CanaryStats(self.fraction, self._checks, self._mismatches, self._dropped, self._pages_checked,
                                 self._pages_wrong, {ns: sorted(t) for ns, t in self._quarantine.items()})

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            try:
                self._jobs.put(None, timeout=5)
            except queue.Full:
                return
            thread.join(timeout=5)
