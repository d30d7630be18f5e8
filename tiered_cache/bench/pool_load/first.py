"""The first loads of a reader that just started: `bench pool-load` runs this module as a process
of its own per path (`python -m tiered_cache.bench.pool_load.first`), the way a new instance comes
up when a cluster scales out. It builds a `TieredCache` the way a user does (the path's tier
from cache settings), lets it settle (`--settle` seconds from construction: what it starts in
the background has time to finish; 0: it loads right after it is built), then loads prefixes it
has never read, one after the other, each checked byte for byte, and prints each load's seconds
as JSON. The first against the median of the rest is what starting costs a request; the first
against a copy of the same bytes into fresh memory (never touched: what a new pool's pages cost
to fault in) is what a reader right after construction pays beyond its memory; beside it the
same copy into fresh pages of a pool laid out as the reader's (a page a slice of every layer's
block), whose first touch costs more where huge pages are faulted in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.bench.pool_load.prefixes import Prefix, Prefixes
from tiered_cache.bench.pool_load.serving import check_pool, clock, load, reader, reader_pool_pages
from tiered_cache.bench.pool_load.sites import Way


@dataclass(frozen=True)
class FirstLoads:
    """A new reader's loads: the first, then the steady ones after it; and the same for a memcpy
    of the same bytes after the same idle time (what the machine itself charges a first
    operation after a pause: a VM's vCPU, caches and TLBs gone cold), in the same process."""

    first_seconds: float
    steady_seconds: list[float]
    settle_s: float
    memcpy_first_seconds: float
    memcpy_steady_seconds: list[float]
    ready: bool = True  # the cache had come up (`TieredCache.warming` ended) by its first load
    up_s: float | None = None  # when it had, from its construction (None: not by the end of the run)
    # A memcpy into never-touched memory: the first a moment before the cache was built (the
    # baseline), the rest once its warm-up had ended.
    fresh_copy_seconds: list[float] = field(default_factory=list)
    # The same pages into never-touched pages of a pool as the reader's (layer-first: each page a
    # slice of every K/V and layer block, the memory asked for huge pages): its own first touch.
    fresh_pool_seconds: list[float] = field(default_factory=list)
    # The path's raw read (its limit) of the same prefixes after the same pause, in the bench's
    # process: what the tier itself charges a first read after idling (a Redis server's memory
    # handed back meanwhile), first then steady.
    limit_seconds: list[float] = field(default_factory=list)

    @property
    def fresh_over_first(self) -> float:
        """A copy into fresh memory over the first load: 1x, the load pays only what its memory
        costs; below, something else (connections, threads, maps made then) is on its path."""
        return self.fresh_copy_seconds[0] / self.first_seconds

    @property
    def fresh_pool_over_first(self) -> float:
        """A copy into fresh pages of a pool like the reader's over the first load."""
        return self.fresh_pool_seconds[0] / self.first_seconds

    @property
    def steady(self) -> float:
        return statistics.median(self.steady_seconds)

    @property
    def first_over_steady(self) -> float:
        return self.first_seconds / self.steady

    @property
    def memcpy_first_over_steady(self) -> float:
        return self.memcpy_first_seconds / statistics.median(self.memcpy_steady_seconds)

    @property
    def limit_first_over_steady(self) -> float | None:
        if len(self.limit_seconds) < 2:
            return None
        return self.limit_seconds[0] / statistics.median(self.limit_seconds[1:])


def limit_after_idle(baseline: Callable[[Prefix], Callable[[], Any]], prefixes: Prefixes, first: int, count: int,
                     idle_s: float) -> list[float]:
    """The raw read `baseline` of prefixes `[first, first + count)` after `idle_s` without any:
    the limit's own first read after a pause, then its steady ones."""
    time.sleep(idle_s)
    return [clock(baseline(prefixes[first + i]))[0] for i in range(count)]


def first_loads(spec_dict: dict[str, Any], mib: float, settings: dict[str, Any], path: str, first: int,
                count: int, settle_s: float, way: str, timeout_s: float = 600) -> FirstLoads:
    """Run a reader process on prefixes `[first, first + count)` (count >= 2) and read its loads."""
    assert count >= 2, "a first load and at least one steady load"
    job = {"spec": spec_dict, "mib": mib, "settings": settings, "path": path, "first": first, "count": count,
           "settle_s": settle_s, "way": way}
    done = subprocess.run([sys.executable, "-m", "tiered_cache.bench.pool_load.first", json.dumps(job)],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"the reader process for {path} failed: {tail}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    loads, memcpy = out["seconds"], out["memcpy_seconds"]
    return FirstLoads(loads[0], loads[1:], settle_s, memcpy[0], memcpy[1:], out["ready"], out["up_s"],
                      out["fresh_copy_seconds"], out["fresh_pool_seconds"])


def _run(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from tiered_cache.model.spec import KVSpec

    prefixes = Prefixes(KVSpec.from_dict(job["spec"]), job["mib"])
    mine = [prefixes[job["first"] + i] for i in range(job["count"])]
    for prefix in mine:  # the bench's own work (the pool check needs the pages): before the cache
        prefix.pages  # noqa: B018
    room = job["count"] + 1  # an instance that just started: its pool and host RAM have room
    src = torch.ones(prefixes.nbytes, dtype=torch.uint8)
    pool_shape = prefixes.spec.pool_shape(reader_pool_pages(prefixes, room))
    # The baselines a moment before the cache is built, into memory held to the end: fresh memory
    # drawn from the same free memory, at the same moment, as the reader's pages (on a VM that
    # hands freed memory back to its host, first touches cost several times more some minutes
    # than others).
    held: list[Any] = []
    fresh = [_fresh_copy(src, held)]
    fresh_pool = [_fresh_pool_copy(mine[0].pages, pool_shape, held)]
    started = time.monotonic()
    cache = reader(prefixes, job["settings"], room, room)
    up: list[float] = []  # when the cache had come up, from its construction
    threading.Thread(target=lambda: (cache.warming.join(), up.append(time.monotonic() - started)), daemon=True).start()
    try:
        if job["path"] in ("host", "tensor"):  # its own prefixes into its host RAM: written, then demoted
            for prefix in mine:
                cache.put(prefix.tokens, prefix.kv())
                cache.evict()
        time.sleep(max(0.0, job["settle_s"] - (time.monotonic() - started)))
        ready = not cache.warming.is_alive()
        seconds = []
        for prefix in mine:
            took, placed = clock(lambda p=prefix: load(cache, p, Way(job["way"])))
            check_pool(cache, placed, prefix)
            del placed
            seconds.append(took)
        # The machine's own first-after-idle cost: a memcpy of the same bytes, after the same pause.
        dst = torch.zeros(prefixes.nbytes, dtype=torch.uint8)
        dst.copy_(src)
        time.sleep(job["settle_s"])
        memcpy = [clock(lambda: dst.copy_(src))[0] for _ in range(job["count"])]
        # Then the same copies once the cache's warm-up has ended (it steps aside for requests,
        # not for these): beside the first ones in the JSON, not in the ratios.
        cache.warming.join(timeout=120)
        held.clear()
        fresh += [_fresh_copy(src) for _ in range(2)]
        fresh_pool += [_fresh_pool_copy(mine[0].pages, pool_shape) for _ in range(2)]
        return {"seconds": seconds, "memcpy_seconds": memcpy, "ready": ready, "up_s": up[0] if up else None,
                "fresh_copy_seconds": fresh, "fresh_pool_seconds": fresh_pool}
    finally:
        cache.close()


def _fresh_copy(src: Any, held: list[Any] | None = None) -> float:
    """Seconds to copy `src` into memory never touched before, asked for huge pages as a pool's
    is (device/memory.py: `empty_cpu`): its own private mapping, so no freed memory is reused (a
    shared one would be shmem, faulted 4 KiB at a time where shmem huge pages are off)."""
    import mmap

    import torch

    from tiered_cache.shm.advice import MADV_HUGEPAGE, madvise

    flat = src.view(torch.uint8).reshape(-1)
    fresh = mmap.mmap(-1, flat.numel(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    dst = torch.frombuffer(fresh, dtype=torch.uint8)  # keeps the map open while it lives
    madvise(dst.data_ptr(), flat.numel(), MADV_HUGEPAGE)
    start = time.perf_counter()
    dst.copy_(flat)
    took = time.perf_counter() - start
    if held is not None:
        held.append(dst)
    return took


def _fresh_pool_copy(pages: Any, pool_shape: tuple[int, ...], held: list[Any] | None = None) -> float:
    """Seconds to copy page-first `pages` into the first pages of a never-touched pool tensor of
    `pool_shape` (`KVSpec.pool_shape`), allocated as `PagePool`'s (`empty_cpu`), one strided copy
    per K/V and layer block as a load into pool pages writes them. With `held`, the pool is kept
    there."""
    import torch

    from tiered_cache.device.memory import empty_cpu

    n = pages.shape[0]
    kv = empty_cpu(pool_shape, pages.dtype)
    source = pages.permute(2, 1, 0, *range(3, pages.dim()))  # (n, L, 2, ...) -> (2, L, n, ...)
    start = time.perf_counter()
    with torch.inference_mode(False):
        kv[:, :, :n].copy_(source)
    took = time.perf_counter() - start
    if held is not None:
        held.append(kv)
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", help="the job as JSON (first_loads writes it)")
    args = parser.parse_args(argv)
    print(json.dumps(_run(json.loads(args.job))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
