"""Start `bench store-traffic`'s client processes (released_clients.py), released together into the
baseline and then into the mix, and report progress while they run."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tiered_cache.bench.released_clients import SPAWN, run_released
from tiered_cache.bench.store_traffic.client import ClientArgs, ClientReport, run_client

_START_TIMEOUT_S = 300.0  # spawning, importing and a warm-up call, many processes on few cores
_END_SLACK_S = 120.0  # the last request may run past the deadline by its calls' deadlines


@dataclass(frozen=True)
class Progress:
    phase: str  # "starting", "baseline", "mix"
    elapsed_s: float  # since the phase began
    requests: int  # of the mix, all clients
    errors: int


def run_traffic_clients(jobs: list[ClientArgs], on_progress: Callable[[Progress], None],
                        every_s: float = 5.0) -> list[ClientReport]:
    """One process per job; returns their reports in job order. Calls `on_progress` every
    `every_s` seconds. Raises RuntimeError naming the client that failed (see `run_released`)."""
    progress = SPAWN.Array("d", 4 * len(jobs), lock=False)  # per client: phase, phase start, requests, errors
    give_up_s = _START_TIMEOUT_S + jobs[0].baseline_s + jobs[0].duration_s + _END_SLACK_S
    return run_released(run_client, [(job, progress, _START_TIMEOUT_S) for job in jobs], give_up_s,
                        on_tick=lambda: on_progress(_progress(progress, len(jobs))), tick_s=every_s)


def _progress(shared: object, n: int) -> Progress:
    values = list(shared)  # type: ignore[call-overload]
    phase = min(int(values[4 * i]) for i in range(n))
    started = [values[4 * i + 1] for i in range(n) if int(values[4 * i]) == phase]
    elapsed = time.monotonic() - min(started) if phase and started else 0.0
    return Progress(("starting", "baseline", "mix")[phase], elapsed, int(sum(values[2::4])), int(sum(values[3::4])))
