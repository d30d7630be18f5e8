"""Clients that keep a tier busy while a test breaks what is behind it.

Each client is a thread with a tier of its own (as each engine has its own), putting pages and
reading them back in a loop. Every blob a read returns is compared byte for byte with what was
put under that key: a difference is counted as `wrong`, which every chaos test requires to be 0.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.wire.codec import encode_page

CHAOS_SPEC = KVSpec("chaos", 4, 4, 64, page_size=32)  # 128 KiB pages: streams are in flight when hit


def chaos_pages(n: int, namespace: str = "chaos", spec: KVSpec = CHAOS_SPEC) -> list[tuple[bytes, bytes]]:
    """`n` pages with distinct random content, keyed as an engine would key them."""
    keys = PageKeyer(spec, namespace).keys(list(range(n * spec.page_size)))
    pages = torch.randn(spec.staging_shape(n), generator=torch.Generator().manual_seed(n)).half()
    return [(k, encode_page(p, spec, k)) for k, p in zip(keys, pages, strict=True)]


@dataclass
class ClientLog:
    """What one client saw: (time, op, pages asked, pages answered, seconds) per call."""

    calls: list[tuple[float, str, int, int, float]] = field(default_factory=list)
    compared: int = 0  # blobs returned and compared with what was put
    wrong: int = 0  # blobs returned that differ from what was put under their key
    crashed: BaseException | None = None

    def answered_after(self, op: str, since: float) -> int:
        return sum(got for t, o, _, got, _ in self.calls if o == op and t >= since)

    def first_answer_after(self, op: str, since: float, full: bool = False) -> float | None:
        return next((t for t, o, asked, got, _ in self.calls
                     if o == op and t >= since and (got == asked if full else got > 0)), None)

    @property
    def slowest_s(self) -> float:
        return max((s for *_, s in self.calls), default=0.0)


class Clients:
    """`n` threads, each `make_tier()`-ing its own tier, writing and reading `pages` until `stop()`."""

    def __init__(self, n: int, make_tier: Callable[[], Any], pages: Sequence[tuple[bytes, bytes]],
                 batch: int = 16) -> None:
        self.pages = list(pages)
        self.expected = dict(self.pages)
        self.batch = batch
        self.logs = [ClientLog() for _ in range(n)]
        self.tiers = [make_tier() for _ in range(n)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def start(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def _run(self, index: int) -> None:
        log, tier, rng = self.logs[index], self.tiers[index], random.Random(index)
        try:
            while not self._stop.is_set():
                chosen = rng.sample(self.pages, self.batch)
                if rng.random() < 0.5:
                    started = time.monotonic()
                    stored = tier.put(chosen)
                    log.calls.append((started, "put", len(chosen), stored, time.monotonic() - started))
                else:
                    keys = [k for k, _ in chosen]
                    started = time.monotonic()
                    got = tier.get(keys)
                    log.calls.append((started, "get", len(keys), sum(b is not None for b in got),
                                      time.monotonic() - started))
                    for key, blob in zip(keys, got, strict=True):
                        if blob is not None:
                            log.compared += 1
                            log.wrong += bytes(blob) != self.expected[key]
        except BaseException as exc:  # a tier must never raise: the test reports it
            log.crashed = exc

    def stop(self, join_timeout_s: float = 20.0) -> list[str]:
        """Stop every client; returns the names of threads still running after the timeout (hung)."""
        self._stop.set()
        deadline = time.monotonic() + join_timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in self._threads if t.is_alive()]
        for tier in self.tiers:
            if not hung and hasattr(tier, "close"):
                tier.close()
        return hung

    def check(self) -> int:
        """Assert no client crashed and none saw wrong bytes; returns how many blobs were compared."""
        for log in self.logs:
            assert log.crashed is None, f"a tier raised into its caller: {log.crashed!r}"
        wrong = sum(log.wrong for log in self.logs)
        assert wrong == 0, f"{wrong} blobs came back with bytes other than those put"
        return sum(log.compared for log in self.logs)

    def answered_after(self, op: str, since: float) -> int:
        return sum(log.answered_after(op, since) for log in self.logs)

    def errors(self) -> int:
        return sum(tier.stats().errors for tier in self.tiers)
