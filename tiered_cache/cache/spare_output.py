"""One pre-faulted CPU output tensor kept ready for the next `TieredCache.get()` without `out=`.

A fresh tensor costs its first touch: the kernel faults in and zeroes every page while `get`
copies into it, slowing that copy well below memcpy even on huge pages (figures in
docs/PERFORMANCE.md). The
spare moves that cost off the request path: `get` takes the spare when it fits and hands it over
for good (it is never reused, so the caller owns it like any new tensor), and a background
thread then allocates and faults in the next one during a quiet moment. At most one spare, the
size of the last result, is held.

A new cache has no last result: its warm-up prepares a first spare (a quarter of the pool, at most
`FIRST_MAX_BYTES`) that the first gets share, each handed the front of what is left, so a reader's
first `get` costs what its later ones do. Only that first spare is shared this way: its memory is
freed once every result cut from it is.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

import torch

from tiered_cache.cache.background import BackgroundQueue, QueueOwner
from tiered_cache.cache.foreground import Foreground
from tiered_cache.device.memory import HUGEPAGE_MIN_BYTES, PretouchThread, empty_cpu

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore

_SLACK = 1.25  # a spare up to this much larger than asked is handed out (the rest rides along)
_QUIET_S = 0.05
_YIELD_S = 0.5  # the longest a chunk of the pre-touch waits for a request to end
FIRST_MAX_BYTES = 512 << 20  # the warm-up's first spare, at most (a quarter of the pool otherwise)


class SpareOutput(QueueOwner):
    def __init__(self, foreground: Foreground, max_bytes: int) -> None:
        # Room for the warm-up's first spare and a get's refill behind it.
        super().__init__(BackgroundQueue("spare-output", capacity=2))
        self.max_bytes = max_bytes
        self._foreground = foreground
        self._spare: torch.Tensor | None = None
        self._shared = False  # the spare is the warm-up's first: each get takes its front
        self._lock = threading.Lock()
        self.taken = 0  # gets served from a spare

    @classmethod
    def for_pool(cls, core: CacheCore) -> SpareOutput | None:
        """A spare for `get()` without `out=` on a CPU pool, as large as the pool at most; None when
        the config turns it off or the pool is on a GPU."""
        if not core.config.spare_output or core.pool.kv.device.type != "cpu":
            return None
        return cls(core.foreground, core.pool.num_pages * core.spec.bytes_per_page)

    def prepare_first(self, dtype: torch.dtype) -> None:
        """Have the background thread fault in the first spare, for the first gets to share."""
        numel = min(self.max_bytes // 4, FIRST_MAX_BYTES) // dtype.itemsize
        if numel * dtype.itemsize >= HUGEPAGE_MIN_BYTES:
            self.queue.submit(self._prepare, numel, dtype, True)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The spare shaped as `shape`, if one of the dtype fits within the slack, or the front of
        the first spare while it lasts; else None."""
        numel = math.prod(shape)
        with self._lock:
            if not self._fits(numel, dtype):
                return None
            spare = self._spare
            assert spare is not None
            rest = spare[numel:]
            keep = self._shared and rest.numel() * rest.element_size() >= HUGEPAGE_MIN_BYTES
            self._spare, self._shared = (rest, True) if keep else (None, False)
        self.taken += 1
        return spare[:numel].view(shape)

    def _fits(self, numel: int, dtype: torch.dtype) -> bool:
        spare = self._spare
        if spare is None or spare.dtype != dtype or numel > spare.numel():
            return False
        return self._shared or spare.numel() <= _SLACK * numel

    def output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The spare for a result of `shape` (or None: the caller allocates), and the next one
        asked for: the next `get` of this size finds its memory faulted in."""
        spare = self.take(shape, dtype)
        self.refill(shape, dtype)
        return spare

    def refill(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Have the background thread prepare a spare of `shape` (dropped when one is on its way,
        too large, or too small to be worth it: the small ones cost little to fault in)."""
        numel = math.prod(shape)
        if HUGEPAGE_MIN_BYTES <= numel * dtype.itemsize <= self.max_bytes:
            self.queue.submit(self._prepare, numel, dtype)

    def close(self) -> None:
        self.queue.close(timeout=5.0)
        with self._lock:
            self._spare = None

    def _prepare(self, numel: int, dtype: torch.dtype, shared: bool = False) -> None:
        with self._lock:
            if self._fits(numel, dtype):  # the next get of this size is served already
                return
        self._foreground.wait_idle(_QUIET_S)
        with torch.inference_mode(False):
            tensor = empty_cpu((numel,), dtype)
        touch = PretouchThread(tensor)
        touch.yield_to = lambda: self._foreground.wait_idle(_YIELD_S)  # a request first: it may be a get
        touch.start()
        touch.join()  # this thread is the background already
        with self._lock:
            self._spare, self._shared = tensor, shared
