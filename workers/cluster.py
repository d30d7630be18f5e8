"""The driver side of `tiered-cache cluster ...` and `stats --ray`: start, inspect, use and stop the
cluster's actors on a running Ray cluster.

Every actor is named and detached in one Ray namespace, so any later driver (another CLI call, on
any node) finds them: `start` is idempotent (it creates what is missing, e.g. a shard that was
killed), and `stop` removes every actor and the shards' placement group.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.cache_worker import CacheWorker
from workers.config import ClusterConfig
from workers.directory import ClusterDirectory
from workers.names import (
    DIRECTORY,
    ROUTER,
    SHARD_PREFIX,
    WORKER_PREFIX,
    is_ours,
    placement_group_name,
    shard_name,
    worker_name,
)
from workers.store_shard import StoreShard

Progress = Callable[[str], None]
START_TIMEOUT_S = 300.0  # a worker loads its model; a fresh node may need minutes on first use


def connect(address: str, namespace: str) -> None:
    """Join the Ray cluster at `address` ("auto" on a cluster node) as a driver in `namespace`."""
    if ray.is_initialized():
        current = ray.get_runtime_context().namespace
        if current != namespace:
            raise RuntimeError(f"this process is connected to Ray namespace {current!r}, not {namespace!r}")
        return
    ray.init(address=address, namespace=namespace, logging_level="WARNING", log_to_driver=False)


def _existing(name: str) -> Any | None:
    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def _detached(cls: type, name: str, **options: Any) -> Any:
    return ray.remote(cls).options(name=name, lifetime="detached", max_restarts=0, **options)


def start_directory(config: ClusterConfig) -> Any:
    return _existing(DIRECTORY) or _detached(ClusterDirectory, DIRECTORY, num_cpus=0).remote(
        health_interval_s=config.watch_interval_s)


def start_shard(name: str, config: ClusterConfig, **options: Any) -> Any:
    """The shard actor `name` (created unless alive); `options` are Ray actor options (placement)."""
    s = config.shard
    options.setdefault("num_cpus", s.num_cpus)
    if s.resources:
        options.setdefault("resources", dict(s.resources))
    return _existing(name) or _detached(StoreShard, name, max_concurrency=8, **options).remote(name, s)


def start_worker(name: str, config: ClusterConfig, **options: Any) -> Any:
    """The worker actor `name` (created unless alive): one GPU where the cluster has GPUs."""
    w = config.worker
    gpus = w.num_gpus if w.num_gpus is not None else (1 if ray.cluster_resources().get("GPU", 0) > 0 else 0)
    options.setdefault("num_cpus", w.num_cpus)
    options.setdefault("num_gpus", gpus)
    if w.resources:
        options.setdefault("resources", dict(w.resources))
    return _existing(name) or _detached(CacheWorker, name, max_concurrency=4, **options).remote(
        name, w, config.shard, config.watch_interval_s)


def start_router(config: ClusterConfig) -> Any:
    from workers.router import PrefixRouter

    return _existing(ROUTER) or _detached(PrefixRouter, ROUTER, num_cpus=0, max_concurrency=64).remote(config.router)


def _shard_group(config: ClusterConfig) -> Any:
    """The shards' SPREAD placement group: one bundle per shard, on different nodes where possible."""
    name = placement_group_name(config.namespace)
    try:
        group = get_placement_group(name)
    except ValueError:
        group = None
    if group is not None and len(group.bundle_specs) != config.shards:
        raise ValueError(f"placement group {name!r} has {len(group.bundle_specs)} shard bundles but the config "
                         f"asks for {config.shards}: run `tiered-cache cluster stop` first")
    if group is None:
        bundle = {"CPU": config.shard.num_cpus, **config.shard.resources}
        group = placement_group([dict(bundle) for _ in range(config.shards)], strategy="SPREAD", name=name,
                                lifetime="detached")
    ray.get(group.ready(), timeout=START_TIMEOUT_S)
    return group


def start(config: ClusterConfig, progress: Progress = lambda _: None) -> list[dict[str, Any]]:
    """Create whatever of directory, shards, workers and router is not running; wait until every
    one answers. Returns each actor's info."""
    start_directory(config)
    actors = []
    if config.shards:
        group = _shard_group(config)
        progress(f"{config.shards} store shard(s), placement group {group.id.hex()[:8]} (SPREAD)")
        for i in range(config.shards):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
            actors.append(start_shard(shard_name(i), config, scheduling_strategy=strategy))
        ray.get([a.ping.remote() for a in actors], timeout=START_TIMEOUT_S)  # workers find them registered
    progress(f"{config.workers} cache worker(s) loading {config.worker.model} ...")
    actors += [start_worker(worker_name(i), config) for i in range(config.workers)]
    actors.append(start_router(config))
    ray.get([a.ping.remote() for a in actors], timeout=START_TIMEOUT_S)
    return [ray.get(a.info.remote()) for a in actors]


def actor_names() -> list[str]:
    """Names of this cluster's live named actors in the current namespace."""
    return sorted(n for n in ray.util.list_named_actors() if is_ours(n))


def _kind_order(name: str) -> tuple[int, str]:
    order = {DIRECTORY: 0, ROUTER: 3}
    return order.get(name, 1 if name.startswith(SHARD_PREFIX) else 2), name


def stats(timeout_s: float = 30.0) -> dict[str, Any]:
    """Every shard's and worker's own figures, plus cluster totals per tier (see `rollup`)."""
    names = [n for n in actor_names() if n.startswith((SHARD_PREFIX, WORKER_PREFIX))]
    refs = {n: ray.get_actor(n).stats.remote() for n in names}
    actors = []
    for name in sorted(refs, key=_kind_order):
        try:
            actors.append(ray.get(refs[name], timeout=timeout_s))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            actors.append({"kind": "shard" if name.startswith(SHARD_PREFIX) else "worker", "name": name,
                           "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
    return {"actors": actors, "totals": rollup(actors)}


_SUMMED = ("capacity_bytes", "used_bytes", "pages", "hits", "misses", "evictions", "promotions", "demotions",
           "bytes_in", "bytes_out", "errors", "corrupt", "breaker_trips", "open_breakers")


def tiers_of(actor: dict[str, Any]) -> list[dict[str, Any]]:
    """One actor's per-tier figures: a worker's cache tiers, a shard's server tiers."""
    if "error" in actor:
        return []
    return actor["cache"]["tiers"] if actor["kind"] == "worker" else actor["tiers"]


def rollup(actors: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tier name, the sum of every actor's figures for that tier (and the hit rate of the sums)."""
    totals: dict[str, dict[str, Any]] = {}
    for actor in actors:
        for tier in tiers_of(actor):
            row = totals.setdefault(tier["name"], {k: 0 for k in _SUMMED})
            for key in _SUMMED:
                row[key] += int(tier.get(key, 0))
    for row in totals.values():
        asked = row["hits"] + row["misses"]
        row["hit_rate"] = row["hits"] / asked if asked else 0.0
    return totals


def generate(prompt: str, max_new_tokens: int | None = None, use_cache: bool = True,
             timeout_s: float = 600.0) -> dict[str, Any]:
    """One request through the router (the worker it chose, why, and the worker's answer)."""
    router = _existing(ROUTER)
    if router is None:
        raise RuntimeError("no router in this namespace: run `tiered-cache cluster start` first")
    return ray.get(router.generate.remote(prompt, max_new_tokens, use_cache), timeout=timeout_s)


def stop(namespace: str, progress: Progress = lambda _: None, timeout_s: float = 60.0) -> list[str]:
    """Shut every actor down (shards flush RAM to disk first), kill it, remove the placement group,
    and wait until no named actor of the cluster is left. Returns the names stopped."""
    names = sorted(actor_names(), key=_kind_order, reverse=True)  # router, workers, shards, directory
    for name in names:
        handle = _existing(name)
        if handle is None:
            continue
        if name != DIRECTORY:
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):  # dead or stuck: killed below
                ray.get(handle.shutdown.remote(), timeout=timeout_s)
        ray.kill(handle, no_restart=True)
        progress(f"stopped {name}")
    with contextlib.suppress(ValueError):
        remove_placement_group(get_placement_group(placement_group_name(namespace)))
    deadline = time.monotonic() + timeout_s
    while actor_names() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = actor_names()
    if left:
        raise RuntimeError(f"actors still alive after stop: {', '.join(left)}")
    return names
