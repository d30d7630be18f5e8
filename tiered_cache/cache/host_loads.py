"""`HostLoads`: host RAM rows straight into device pages, the load stage with no staging copy.

One DMA per run of rows on CUDA (`device/host_copy.py`), one strided copy per run on a CPU pool.
On CUDA a load returns once its copies are queued: the caller's stream waits for them (the
engine's forward is queued while the DMA runs), the host slab's fence keeps their rows unwritten
(`HostTier.reading`) and a pin keeps their pages from being handed out again meanwhile; `settle`
lifts the pins once the copies end and takes their time as the reuse policy's sample.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from tiered_cache.device.copy_stream import QueuedCopy
from tiered_cache.tiers.base import Tier

if TYPE_CHECKING:
    from tiered_cache.device.host_copy import HostCopier
    from tiered_cache.device.pool import PagePool
    from tiered_cache.tiers.host import HostTier


class HostLoads:
    """Host RAM -> pool copies of one cache, and the ones still running (CUDA)."""

    def __init__(self, pool: PagePool, host: HostTier, copier: HostCopier,
                 observe: Callable[[str, float, int], None]) -> None:
        self.pool, self.host = pool, host
        # The cache's one copier: its one copy stream orders these reads of host rows before a
        # demotion writes over them (`HostTier.before_ordered_write`).
        self.copier = copier
        self._observe = observe  # (tier, seconds, pages): the reuse policy's sample
        # Copies queued (CUDA), oldest first, with the pages they fill (pinned until settled).
        self._queued: deque[tuple[QueuedCopy, np.ndarray]] = deque()
        self.last: QueuedCopy | None = None  # the newest of them, done or not

    def to_pool(self, rows: np.ndarray, pages: np.ndarray) -> None:
        """Copy host RAM `rows` into device `pages` (the caller holds the cache's lock, so the rows
        stay put until the copy is noted). On CUDA this returns once the copies are queued, the
        current stream waiting for them; until they end, the slab's fence keeps the rows
        unwritten and a pin keeps the pages from being handed out again, should they be freed
        meanwhile (adopted as duplicates of pages another request loaded, or evicted)."""
        self.settle()
        started = time.perf_counter()
        queued = self.copier.to_pool(self.host.slab, rows, pages, wait=False)
        if queued is None:
            self._observe(Tier.HOST.value, time.perf_counter() - started, len(pages))
            return
        self.pool.pin(pages)
        self.host.reading(queued)
        self._queued.append((queued, pages))
        self.last = queued

    def settle(self, wait: bool = False) -> None:
        """The copies that have finished (all, after waiting, with `wait`): their pages unpinned,
        their time on the copy stream sampled for the reuse policy (lock held)."""
        if wait and self.last is not None:
            self.last.wait()
        while self._queued and self._queued[0][0].finished():  # they finish in order
            queued, pages = self._queued.popleft()
            self.pool.unpin(pages)
            self._observe(Tier.HOST.value, queued.seconds(), len(pages))

    def stream_waits(self) -> None:
        """Make the current stream wait for the copies still running (the newest stands for all:
        they run in order on one copy stream). Pages are in the tree once their copy is queued,
        so a request on another stream that finds them, as a device hit, first waits here; the
        host does not block."""
        last = self.last
        if last is not None and not last.finished():
            torch.cuda.current_stream(self.pool.device).wait_event(last.done)
