"""`tiered-cache bench store-traffic`: N client processes against one store server for a bounded time,
in a mix that looks like serving (workload.py): lookups of shared system prompts and of
multi-turn histories, gets of the held pages (every blob checked byte for byte), puts of each
turn's new pages, with a Zipf-like popularity. Reports calls/s and p50/p99/p999 per operation
beside a same-run baseline (as many processes doing 1-key Lookups), errors by kind, and the
server's RSS over the run, which must level off at its configured capacities.

The store server is started here (RAM only, or RAM over a temporary disk folder) unless an
`--address` is given; then its RSS is sampled only with `--server-pid`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tiered_cache.bench.store_traffic.client import OPS, ClientArgs, Timeline
from tiered_cache.bench.store_traffic.report import TierFigures, TrafficResult, summarise
from tiered_cache.bench.store_traffic.rss import RssSampler
from tiered_cache.bench.store_traffic.runner import Progress, run_traffic_clients
from tiered_cache.bench.store_traffic.workload import PagePayloads, Workload
from tiered_cache.model.units import format_binary, parse_size
from tiered_cache.tiers.base import Tier


@dataclass(frozen=True)
class TrafficSettings:
    workload: Workload
    clients: int = 8
    duration_s: float = 60.0
    ram: str = "256MiB"  # the server's RAM tier, when this bench starts the server
    disk: str | None = None  # a disk tier of this size in a temporary folder; None: RAM only
    address: str | None = None  # a running server instead of one started here
    server_pid: int | None = None
    timeout_s: float = 10.0  # each call's deadline (a stream's: its progress deadline)
    png: str | None = None

    def __post_init__(self) -> None:
        if self.clients <= 0 or not self.duration_s > 0 or not self.timeout_s > 0:
            raise ValueError(f"bench store-traffic: --clients, --duration-s and --timeout-s must be positive, got "
                             f"{self.clients}, {self.duration_s:g}, {self.timeout_s:g}")
        parse_size(self.ram)
        if self.disk is not None:
            parse_size(self.disk)

    @property
    def baseline_s(self) -> float:
        return min(5.0, max(0.5, self.duration_s / 6))


@contextlib.contextmanager
def _server(settings: TrafficSettings) -> Iterator[tuple[str, int | None]]:
    """The address and pid of the store server under test."""
    if settings.address:
        yield settings.address, settings.server_pid
        return
    from tiered_cache.server.process import StoreProcess

    with tempfile.TemporaryDirectory(prefix="tiered-cache-store-traffic-") as tmp:
        lower = ["--disk", tmp, "--disk-capacity", settings.disk] if settings.disk else ["--no-disk"]
        with StoreProcess([*lower, "--ram", settings.ram]) as store:
            assert store.proc is not None
            yield store.address, store.proc.pid


def _put_prompts(address: str, workload: Workload, timeout_s: float) -> int:
    """The shared system prompts put before the run, as a serving fleet would have them; returns their pages."""
    from tiered_cache.client.store_client import StoreClient

    payloads, keys = PagePayloads(workload), [k for prompt in workload.prompt_keys() for k in prompt]
    with StoreClient(address, timeout_s=timeout_s) as client:
        client.put(((k, payloads.blob(k)) for k in keys), bytes.fromhex(workload.spec.fingerprint))
    return len(keys)


def _tier_figures(address: str, timeout_s: float) -> list[TierFigures]:
    from tiered_cache.client.store_client import StoreClient

    with StoreClient(address, timeout_s=timeout_s) as client:
        tiers = client.stats().tiers
    return [TierFigures(t.name, t.used_bytes, t.capacity_bytes, t.pages, t.evictions) for t in tiers]


def bench_store_traffic(settings: TrafficSettings, progress: Callable[[str], None] = lambda m: None) -> TrafficResult:
    """Run the baseline and the mix; write the PNG if `settings.png`. Raises RuntimeError when a
    client process fails outright (errors of single calls are counted, not raised)."""
    w = settings.workload
    with _server(settings) as (address, pid):
        sampler = RssSampler(pid).start() if pid else None
        try:
            prompt_pages = _put_prompts(address, w, settings.timeout_s)
            progress(f"{prompt_pages:,} system-prompt pages put; starting {settings.clients} client processes: "
                     f"{settings.baseline_s:g} s of 1-key Lookups, then {settings.duration_s:g} s of the mix ...")
            jobs = [ClientArgs(address, w, i, settings.timeout_s, settings.baseline_s, settings.duration_s)
                    for i in range(settings.clients)]

            def report(p: Progress) -> None:
                rss = f", server RSS {format_binary(sampler.latest)}" if sampler and sampler.latest else ""
                mix = f", {p.requests:,} requests, {p.errors:,} errors" if p.phase == "mix" else ""
                progress(f"  {p.phase} {p.elapsed_s:.0f} s{mix}{rss}")

            reports = run_traffic_clients(jobs, report)
        finally:
            if sampler:
                sampler.stop()
        tiers = _tier_figures(address, settings.timeout_s)
    blob_bytes = len(PagePayloads(w).blob(bytes(32)))
    result = summarise(reports, sampler.samples if sampler else [], prompt_pages, blob_bytes, tiers, settings.png)
    if settings.png:
        from tiered_cache.bench.store_traffic.plot import write_png

        start = min(r.window[0] for r in reports)
        timelines = {op: Timeline.merged([r.ops[op] for r in reports]) for op in OPS}
        timelines["baseline"] = Timeline.merged([r.baseline for r in reports])
        ram = next((t.capacity for t in tiers if t.name == Tier.RAM), None)
        title = (f"bench store-traffic: {settings.clients} clients, {w.page_kib} KiB pages, "
                 f"RAM tier {format_binary(ram or 0)}")
        write_png(settings.png, timelines, start, {"server": sampler.samples if sampler else []}, ram, title)
    return result


def run_store_traffic_bench(args: argparse.Namespace) -> int:
    """The CLI's entry: settings from `args`, progress to stderr, a table or JSON to stdout."""
    workload = Workload(page_kib=args.page_kib, prompts=args.prompts, histories=args.histories,
                        zipf_s=args.zipf_s, seed=args.seed)
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.ray:
        return _run_ray(args, workload, progress)
    settings = TrafficSettings(workload, args.clients, args.duration_s, args.ram, args.disk, args.address,
                               args.server_pid, args.timeout_s or 10.0, args.png)
    result = bench_store_traffic(settings, progress=progress)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        from tiered_cache.bench.store_traffic.table import render_traffic

        print(render_traffic(result))
    return 0


def _run_ray(args: argparse.Namespace, workload: Workload, progress: Callable[[str], None]) -> int:
    if args.server_pid is not None:
        raise ValueError("bench store-traffic --ray samples the RSS of every shard and worker on this host: "
                         "drop --server-pid")
    from tiered_cache.bench.store_traffic.ray_table import render_ray_traffic
    from tiered_cache.bench.store_traffic.through_ray import RayTrafficSettings, bench_store_traffic_ray

    settings = RayTrafficSettings(workload, args.clients, args.duration_s, args.workers, args.shards, args.ram,
                                  args.worker_pool, args.worker_host, args.disk, args.address, args.namespace,
                                  args.max_new_tokens, args.timeout_s or 120.0, args.verify, args.png)
    from tiered_cache.workers.cluster import stdout_for_the_answer

    out = stdout_for_the_answer()  # the results alone on stdout, Ray's driver talking or not
    result = bench_store_traffic_ray(settings, progress=progress)
    print(json.dumps(result.to_dict(), indent=2) if args.json else render_ray_traffic(result), file=out)
    return 0
