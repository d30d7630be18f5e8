"""What a new cache opens and faults in ahead of its first request, on a daemon thread started
with the cache: the lower tiers' connections and threads (`TierChain.warm`: a store server's
channels and arena maps, disk's reader threads), the prefetch threads, and on CUDA the pinned
staging a load from below goes through (pinning is slow: the first load must not pay it); the
constructor waits for those (at most `OPEN_WAIT_S`), not for the memory faulted in after them. A
reader's first load then costs what its tenth does (docs/PERFORMANCE.md, "bench pool-load").
Nothing here is needed for correctness: a failure is logged and the first request pays instead.

`collect_leftovers`, called by the constructor: a full garbage collection of what building the
cache left behind. Left to itself, CPython's oldest-generation collection went off in the middle
of a reader's first load (0.05-0.1 s with the GIL held); run on this thread it fell beside the
first loads whose rates the reuse policy measures. At most once a minute in a process: one that
builds many caches (a test suite, a benchmark) pays it once, not once a cache.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Sequence

from tiered_cache.cache.foreground import PROCESS, Foreground
from tiered_cache.cache.tier_loads import TierLoads
from tiered_cache.device.memory import PretouchThread
from tiered_cache.shm import read_ahead
from tiered_cache.tiers.chain import TierChain

log = logging.getLogger("tiered_cache.cache.warm_up")
_YIELD_S = 0.5  # the longest a pre-touch chunk waits for a request to end (it is not urgent)
# The longest a new cache's constructor waits for its tiers to open (connections, maps, threads):
# a request made right after it then pays only for its memory. A tier slower than that (a server
# that does not answer) goes on opening in the background, as every tier did before.
OPEN_WAIT_S = 2.0
COLLECT_EVERY_S = 60.0  # a process's caches collect their leftovers at most this often
_collected_at: float | None = None  # monotonic time of the last `collect_leftovers` that collected


def collect_leftovers() -> bool:
    """A full garbage collection unless one ran less than `COLLECT_EVERY_S` ago; whether it ran."""
    global _collected_at
    now = time.monotonic()
    if _collected_at is not None and now - _collected_at < COLLECT_EVERY_S:
        return False
    gc.collect()
    _collected_at = time.monotonic()
    return True


def _wait_for_quiet_process() -> None:
    PROCESS.wait_idle(_YIELD_S)


def warm_up_async(chain: TierChain, tier_loads: TierLoads, pretouches: Sequence[PretouchThread | None] = (),
                  foreground: Foreground | None = None, open_wait_s: float = OPEN_WAIT_S) -> threading.Thread:
    """Start warming `chain` and `tier_loads` up on a daemon thread; returns the thread, which ends
    once that is done and the `pretouches` (the pool's, host RAM's) have ended too: joining it
    waits until the cache is ready (`TieredCache.warming`). Returns once the tiers and loads are
    warm (or failed to), or after `open_wait_s`, so a request made at once finds them open; the
    pre-touches go on. With `foreground`, the pre-touches step aside while a request runs (at most
    `_YIELD_S` per chunk)."""
    # An arena map's read-ahead serves every cache of the process: it steps aside for any request.
    read_ahead.step_aside = _wait_for_quiet_process
    for pretouch in pretouches:
        if pretouch is not None and foreground is not None and pretouch.preserves_bytes:
            pretouch.yield_to = lambda: foreground.wait_idle(_YIELD_S)

    def run() -> None:
        try:
            tier_loads.warm()
            chain.warm()
        except Exception as exc:  # the first request opens what this could not
            log.info("warming up the cache's tiers failed (%s: %s); the first load opens them", type(exc).__name__, exc)
        finally:
            opened.set()
        for thread in pretouches:
            if thread is not None and thread.is_alive():
                thread.join()

    opened = threading.Event()
    thread = threading.Thread(target=run, name="tiered-cache-warm-up", daemon=True)
    thread.start()
    opened.wait(open_wait_s)
    return thread
