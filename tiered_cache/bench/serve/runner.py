"""Send a workload open-loop: each request leaves at its arrival time whatever the ones before it
are doing (a thread each, from a bounded pool), as users arrive at a service."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.bench.serve.client import Outcome, send
from tiered_cache.bench.serve.workload import ServeRequest

MAX_IN_FLIGHT = 64  # client threads; past it a request leaves late (counted in its own TTFT)


@dataclass
class WayRun:
    way: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    router: dict[str, Any] | None = None  # our request router's stats at the end (`front_end_figures`)


def run_way(way: str, url: str, token: str | None, requests: list[ServeRequest], model: str, max_tokens: int,
            salt: str | None) -> WayRun:
    run = WayRun(way)
    started = time.perf_counter()
    with ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="bench-serve") as pool:
        futures = []
        for request in requests:
            delay = started + request.arrival_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(send, url, token, request.key, request.body(model, max_tokens, salt)))
        run.outcomes = [f.result() for f in futures]
    run.wall_s = time.perf_counter() - started
    return run
