"""Client processes for the benchmarks that measure many clients at once (`bench remote --clients`,
`bench store-traffic`): spawned (nothing shared but what is passed), released together by a barrier once
all are warm, each putting `(index, report)` or `(index, "error text")` on a queue.

`run_released` starts them, waits for every report, and turns a failure into one clear error: the
client that failed first (not those whose release its abort broke), or the ones that died
without a word, or all of them when the time is up.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

SPAWN = multiprocessing.get_context("spawn")


def run_released(target: Callable[..., None], args: Sequence[tuple[Any, ...]], give_up_s: float,
                 names: Sequence[str] | None = None, on_tick: Callable[[], None] = lambda: None,
                 tick_s: float = 5.0) -> list[Any]:
    """One process per `args` entry, running `target(index, barrier, results, *entry)`; returns
    their reports in order. Calls `on_tick` every `tick_s` seconds while waiting. Raises
    RuntimeError when a client failed, died silently, or not all reported within `give_up_s`."""
    n = len(args)
    barrier, results = SPAWN.Barrier(n), SPAWN.Queue()
    procs = [SPAWN.Process(target=target, args=(i, barrier, results, *a), daemon=True) for i, a in enumerate(args)]
    for proc in procs:
        proc.start()
    reports: dict[int, Any] = {}
    give_up, next_tick = time.monotonic() + give_up_s, time.monotonic() + tick_s
    try:
        while len(reports) < n:
            try:
                index, report = results.get(timeout=0.5)
                reports[index] = report
                continue
            except queue.Empty:
                pass
            silent = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in reports]
            if (silent and results.empty()) or time.monotonic() > give_up:
                barrier.abort()
                raise RuntimeError(f"client processes {silent or 'all'} never reported "
                                   f"(exit codes {[p.exitcode for p in procs]})")
            if time.monotonic() >= next_tick:
                on_tick()
                next_tick += tick_s
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
    failed = sorted((r.startswith("BrokenBarrierError"), i, r) for i, r in reports.items() if isinstance(r, str))
    if failed:
        _, index, error = failed[0]
        name = f" ({names[index]})" if names else ""
        raise RuntimeError(f"client {index} of {n}{name} failed: {error}")
    return [reports[i] for i in range(n)]
