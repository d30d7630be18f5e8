"""Start `bench load`'s client processes (spawned: nothing shared but what is passed), release
them together into the baseline and then into the mix, report progress while they run, and
collect their reports."""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from tiered_cache.bench.load_client import ClientArgs, ClientReport, run_client

_START_TIMEOUT_S = 300.0  # spawning, importing and a warm-up call, many processes on 2 cores
_END_SLACK_S = 120.0  # the last request may run past the deadline by its calls' deadlines


@dataclass(frozen=True)
class Progress:
    phase: str  # "starting", "baseline", "mix"
    elapsed_s: float  # since the phase began
    requests: int  # of the mix, all clients
    errors: int


def run_load_clients(jobs: list[ClientArgs], on_progress: Callable[[Progress], None],
                     every_s: float = 5.0) -> list[ClientReport]:
    """One process per job; returns their reports in job order. Calls `on_progress` every
    `every_s` seconds. Raises RuntimeError naming the client that failed (the cause, not those
    whose release it broke) or that died without a word."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(jobs)), ctx.Queue()
    progress = ctx.Array("d", 4 * len(jobs), lock=False)  # per client: phase, phase start, requests, errors
    procs = [ctx.Process(target=run_client, args=(job, barrier, progress, results, _START_TIMEOUT_S), daemon=True)
             for job in jobs]
    for proc in procs:
        proc.start()
    reports: dict[int, ClientReport | str] = {}
    give_up = time.monotonic() + _START_TIMEOUT_S + jobs[0].baseline_s + jobs[0].duration_s + _END_SLACK_S
    next_report = time.monotonic() + every_s
    try:
        while len(reports) < len(jobs):
            try:
                index, report = results.get(timeout=0.5)
                reports[index] = report
                continue
            except queue.Empty:
                pass
            silent = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in reports]
            if (silent and results.empty()) or time.monotonic() > give_up:
                barrier.abort()
                raise RuntimeError(f"load clients {silent or 'all'} never reported "
                                   f"(exit codes {[p.exitcode for p in procs]})")
            if time.monotonic() >= next_report:
                on_progress(_progress(progress, len(jobs)))
                next_report += every_s
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
    failed = sorted((r.startswith("BrokenBarrierError"), i, r) for i, r in reports.items() if isinstance(r, str))
    if failed:
        _, index, error = failed[0]
        raise RuntimeError(f"load client {index} of {len(jobs)} failed: {error}")
    return [r for _, r in sorted(reports.items()) if isinstance(r, ClientReport)]


def _progress(shared: object, n: int) -> Progress:
    values = list(shared)  # type: ignore[call-overload]
    phase = min(int(values[4 * i]) for i in range(n))
    started = [values[4 * i + 1] for i in range(n) if int(values[4 * i]) == phase]
    elapsed = time.monotonic() - min(started) if phase and started else 0.0
    return Progress(("starting", "baseline", "mix")[phase], elapsed, int(sum(values[2::4])), int(sum(values[3::4])))
