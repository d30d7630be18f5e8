"""`tiered-cache bench store-traffic --ray`: N client actors send the chat form of the traffic mix through the
router of a Ray cluster for a bounded time, first without the cache (recompute: the same-run
baseline), then with it. Every answer is compared with the recompute answer for its prompt (those
the baseline did not ask are recomputed afterwards, up to `verify` of them), and the RSS of every
shard and worker on this host is sampled over the run.

Without `address` a local Ray instance and a cluster (shards, workers, router) in the bench's own
namespace are started and stopped. With one, a router already running in `namespace` is used and
left running (e.g. `tiered-cache cluster start`); if there is none, one is started and stopped.
Ray and `workers/` are imported inside the functions that use them: the settings check without Ray.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tiered_cache.bench.store_traffic.chat import ChatWorkload
from tiered_cache.bench.store_traffic.client import Timeline
from tiered_cache.bench.store_traffic.report import RayTrafficResult, check_answers, memory_figures, phase_figures
from tiered_cache.bench.store_traffic.rss import RssSampler
from tiered_cache.bench.store_traffic.workload import Workload
from tiered_cache.model.units import format_binary, parse_size

if TYPE_CHECKING:
    from tiered_cache.bench.store_traffic.ray_client import ChatReport

NAMESPACE = "tiered-cache-store-traffic"
_RELEASE_S = 1.0  # clients are released together this long after they are told to start
_END_SLACK_S = 30.0


@dataclass(frozen=True)
class RayTrafficSettings:
    workload: Workload
    clients: int = 8
    duration_s: float = 60.0
    workers: int = 2  # when the cluster is started here
    shards: int = 1
    ram: str = "256MiB"  # each started shard's RAM tier
    worker_pool: str = "64MiB"  # each started worker's device pool and host RAM: small, so pages
    worker_host: str = "128MiB"  # move down to the shards and come back from them under load
    disk: str | None = None  # each started shard's disk tier (temporary folder); None: RAM only
    address: str | None = None  # a running Ray cluster; None: start a local one
    namespace: str = NAMESPACE
    max_new_tokens: int = 2
    timeout_s: float = 120.0  # each request's deadline
    verify: int = 32  # prompts the baseline did not ask, recomputed afterwards to check their answers
    png: str | None = None

    def __post_init__(self) -> None:
        if min(self.clients, self.workers, self.max_new_tokens) <= 0 or self.shards < 0 or self.verify < 0:
            raise ValueError("bench store-traffic --ray: --clients, --workers and --max-new-tokens must be positive, "
                             "--shards and --verify not negative")
        if not self.duration_s > 0 or not self.timeout_s > 0:
            raise ValueError(f"bench store-traffic --ray: --duration-s and --timeout-s must be positive, got "
                             f"{self.duration_s:g}, {self.timeout_s:g}")
        for size in (self.ram, self.worker_pool, self.worker_host):
            parse_size(size)
        if self.disk is not None:
            parse_size(self.disk)

    @property
    def baseline_s(self) -> float:
        return min(30.0, max(2.0, self.duration_s / 4))


def _has_router() -> bool:
    import ray

    from tiered_cache.workers.names import ROUTER

    try:
        ray.get_actor(ROUTER)
        return True
    except ValueError:
        return False


def _samplers() -> dict[str, RssSampler]:
    """An RSS sampler (wall-clock times) for every shard and worker on this host."""
    import ray

    from tiered_cache.workers import cluster
    from tiered_cache.workers.names import SHARD_PREFIX, WORKER_PREFIX

    here = ray.util.get_node_ip_address()
    names = [n for n in cluster.actor_names() if n.startswith((SHARD_PREFIX, WORKER_PREFIX))]
    infos = ray.get([ray.get_actor(n).info.remote() for n in names], timeout=60)
    return {i["name"]: RssSampler(i["pid"], clock=time.time).start() for i in infos if i["node_ip"] == here}


def _warm_up(chat: ChatWorkload) -> None:
    """One short recompute on every worker, so the baseline does not pay first-forward costs."""
    import ray

    from tiered_cache.workers import cluster
    from tiered_cache.workers.names import WORKER_PREFIX

    names = [n for n in cluster.actor_names() if n.startswith(WORKER_PREFIX)]
    prompt = chat.system_prompts[0][:200]
    ray.get([ray.get_actor(n).generate.remote(prompt, 1, False) for n in names], timeout=cluster.START_TIMEOUT_S)


def _run_phase(clients: list[Any], phase: str, use_cache: bool, duration_s: float, timeout_s: float,
               progress: Callable[[str], None]) -> list[ChatReport]:
    import ray

    refs = [c.run.remote(phase, use_cache, time.time() + _RELEASE_S, duration_s) for c in clients]
    give_up = time.monotonic() + _RELEASE_S + duration_s + timeout_s + _END_SLACK_S
    started = time.monotonic()
    while True:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        if len(done) == len(refs):
            return ray.get(refs)
        if time.monotonic() > give_up:
            raise RuntimeError(f"bench store-traffic --ray: {len(refs) - len(done)} client(s) never finished "
                               f"the {phase} phase")
        counts = ray.get([c.progress.remote() for c in clients], timeout=30)
        progress(f"  {phase} {time.monotonic() - started:.0f} s: {sum(n for n, _ in counts):,} answers, "
                 f"{sum(e for _, e in counts):,} errors")


def _recompute(reports: list[ChatReport], settings: RayTrafficSettings) -> tuple[dict[str, tuple[int, ...]], int]:
    """Recompute up to `settings.verify` prompts answered with the cache that the baseline did not
    ask; returns their answers and how many recomputes failed."""
    import ray

    from tiered_cache.workers.names import ROUTER

    asked = {k for r in reports if r.phase == "recompute" for k in r.answers}
    prompts = {k: p for r in reports if r.phase == "cache" for k, p in r.prompts.items() if k not in asked}
    chosen = random.Random(settings.workload.seed).sample(sorted(prompts), min(settings.verify, len(prompts)))
    router = ray.get_actor(ROUTER)
    refs = {k: router.generate.remote(prompts[k], settings.max_new_tokens, False) for k in chosen}
    answers, failed = {}, 0
    deadline = time.monotonic() + settings.timeout_s + 10.0 * len(refs)  # they queue behind each other
    for key, ref in refs.items():
        try:
            answers[key] = tuple(ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))["tokens"])
        except (ray.exceptions.RayError, TimeoutError):  # counted; the other prompts are still checked
            failed += 1
    return answers, failed


def _start_ray(settings: RayTrafficSettings) -> bool:
    """Connect or start Ray; returns whether this call started it."""
    import ray

    from tiered_cache.workers import cluster

    if settings.address is not None:
        cluster.connect(settings.address, settings.namespace)
        return False
    if ray.is_initialized():
        return False
    ray.init(num_cpus=settings.workers + settings.shards + 1, namespace=settings.namespace, include_dashboard=False,
             object_store_memory=200 * 2**20, logging_level="WARNING", log_to_driver=False)
    return True


def bench_store_traffic_ray(settings: RayTrafficSettings,
                            progress: Callable[[str], None] = lambda _: None) -> RayTrafficResult:
    import ray

    from tiered_cache.workers import cluster
    from tiered_cache.workers.config import ClusterConfig, ShardSettings, WorkerSettings

    started_ray = _start_ray(settings)
    own_cluster = not _has_router()
    try:
        with tempfile.TemporaryDirectory(prefix="tiered-cache-store-traffic-ray-") as folder:
            if own_cluster:
                config = ClusterConfig(namespace=settings.namespace, shards=settings.shards, workers=settings.workers,
                                       worker=WorkerSettings(max_new_tokens=settings.max_new_tokens,
                                                             pool_capacity=settings.worker_pool,
                                                             host_capacity=settings.worker_host),
                                       shard=ShardSettings(disk_path=folder if settings.disk else None,
                                                           disk_capacity=settings.disk or "1GiB",
                                                           ram_capacity=settings.ram))
                progress(f"starting {settings.workers} worker(s) and {settings.shards} shard(s) ...")
                cluster.start(config)
            try:
                return _measure(settings, progress)
            finally:
                if own_cluster:
                    cluster.stop(settings.namespace)
    finally:
        if started_ray:
            ray.shutdown()


def _measure(settings: RayTrafficSettings, progress: Callable[[str], None]) -> RayTrafficResult:
    import ray

    from tiered_cache.bench.store_traffic.ray_client import TrafficClient
    from tiered_cache.workers import cluster

    chat = ChatWorkload(settings.workload)
    actor = ray.remote(TrafficClient).options(num_cpus=0, max_concurrency=2)
    clients = [actor.remote(chat, i, settings.timeout_s, settings.max_new_tokens) for i in range(settings.clients)]
    samplers = _samplers()
    try:
        ray.get([c.ready.remote() for c in clients], timeout=cluster.START_TIMEOUT_S)
        _warm_up(chat)
        progress(f"{settings.clients} clients: {settings.baseline_s:g} s without the cache (recompute), then "
                 f"{settings.duration_s:g} s with it; RSS of {', '.join(sorted(samplers)) or 'no actor on this host'}")
        reports = _run_phase(clients, "recompute", False, settings.baseline_s, settings.timeout_s, progress)
        reports += _run_phase(clients, "cache", True, settings.duration_s, settings.timeout_s, progress)
    finally:
        for sampler in samplers.values():
            sampler.stop()
        for c in clients:
            ray.kill(c)
    progress(f"recomputing up to {settings.verify} prompts answered from the cache, to compare answers ...")
    recomputed, failed = _recompute(reports, settings)
    baseline = phase_figures([r for r in reports if r.phase == "recompute"])
    mix = phase_figures([r for r in reports if r.phase == "cache"])
    start = min(r.window[0] for r in reports if r.phase == "cache")
    end = max(r.window[1] for r in reports if r.phase == "cache")
    memory = memory_figures({n: s.samples for n, s in samplers.items()}, start, end)
    stats = cluster.stats()
    kinds = Counter(a.get("kind") for a in stats["actors"])
    answers = replace(check_answers(reports, recomputed), failed=failed)
    result = RayTrafficResult(kinds["worker"], kinds["shard"], settings.max_new_tokens, baseline, mix, answers,
                              memory, stats["totals"], settings.png)
    if settings.png:
        _plot(settings, reports, samplers, start)
    return result


def _plot(settings: RayTrafficSettings, reports: list[ChatReport], samplers: dict[str, RssSampler],
          start: float) -> None:
    from tiered_cache.bench.store_traffic.plot import write_png

    timelines = {"recompute": Timeline.merged([r.requests for r in reports if r.phase == "recompute"]),
                 "with cache": Timeline.merged([r.requests for r in reports if r.phase == "cache"])}
    title = (f"bench store-traffic --ray: {settings.clients} clients through the router, shard RAM "
             f"{format_binary(parse_size(settings.ram))}")
    write_png(settings.png, timelines, start, {n: s.samples for n, s in samplers.items()}, None, title,
              ylabel="request latency (ms), per 1 s window")
