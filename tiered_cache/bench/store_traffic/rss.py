"""A server's resident memory over time (VmRSS from /proc/PID/status, Linux) and whether it
levelled off: a store at its configured capacities must stop growing once full."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PLATEAU_GROWTH = 0.05  # the last third's median may exceed the middle third's by this fraction ...
PLATEAU_SLACK = 16 * 2**20  # ... or by this many bytes, whichever is larger


def read_rss(pid: int) -> int | None:
    """Resident bytes of process `pid`, or None when it is gone or this is not Linux."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB, meaning KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """`samples`: (clock(), bytes) every `interval_s`, from `start()` until `stop()`."""

    def __init__(self, pid: int, interval_s: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid, self.interval_s, self.clock = pid, interval_s, clock
        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    @property
    def latest(self) -> int | None:
        return self.samples[-1][1] if self.samples else None

    def _run(self) -> None:
        while True:
            rss = read_rss(self.pid)
            if rss is not None:
                self.samples.append((self.clock(), rss))
            if self._done.wait(self.interval_s):
                return


@dataclass(frozen=True)
class Plateau:
    """RSS over the middle and the last third of a run: the median (the level the process sits at)
    and the largest (its peaks). The verdict is on the medians: a leak lifts the whole curve, while
    a process that runs a model peaks briefly on a long prompt and gives that memory back."""

    middle_max: int
    last_max: int
    middle_median: int
    last_median: int

    @property
    def growth(self) -> int:
        return self.last_median - self.middle_median

    @property
    def growth_pct(self) -> float:
        return 100.0 * self.growth / self.middle_median if self.middle_median else 0.0

    @property
    def peak_growth(self) -> int:
        return self.last_max - self.middle_max

    @property
    def levelled_off(self) -> bool:
        return self.growth < max(PLATEAU_GROWTH * self.middle_median, PLATEAU_SLACK)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "growth": self.growth, "growth_pct": self.growth_pct, "peak_growth": self.peak_growth,
                "plateau": self.levelled_off}


def plateau(samples: list[tuple[float, int]], start: float, end: float) -> Plateau | None:
    """The verdict over the window [start, end]; None when a third of it has no sample."""
    third = (end - start) / 3
    middle = [rss for t, rss in samples if start + third <= t < start + 2 * third]
    last = [rss for t, rss in samples if start + 2 * third <= t <= end]
    if not middle or not last:
        return None
    return Plateau(max(middle), max(last), int(statistics.median(middle)), int(statistics.median(last)))
