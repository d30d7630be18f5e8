"""The driver side of `tiered-cache cluster ...` and `stats --ray`: start, inspect, use and stop the
cluster's actors on a running Ray cluster.

Every actor is named and detached in one Ray namespace, so any later driver (another CLI call, on
any node) finds them: `start` is idempotent (it creates what is missing, e.g. a shard that was
killed), and `stop` removes every actor and the shards' placement group.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import ray
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tiered_cache.workers.cache_worker import CacheWorker
from tiered_cache.workers.config import ClusterConfig, EngineName
from tiered_cache.workers.directory import ClusterDirectory
from tiered_cache.workers.names import (
    DIRECTORY,
    ROUTER,
    SHARD_PREFIX,
    WORKER_PREFIX,
    http_app_name,
    is_ours,
    member_index,
    placement_group_name,
    serve_llm_app_name,
    shard_name,
    worker_name,
)
from tiered_cache.workers.placement import shard_strategy, start_timeout_message
from tiered_cache.workers.store_shard import StoreShard

Progress = Callable[[str], None]
PROGRESS_S = 10.0  # how often a start that waits says what for
START_TIMEOUT_S = 300.0  # benchmarks' warm-up calls: a worker loads its model on first use
CONNECT_TIMEOUT_S = 10.0  # a wrong or dead Ray address fails within this


def connect(address: str, namespace: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Join the Ray cluster at `address` ("auto" on a cluster node) as a driver in `namespace`. A
    HOST:PORT nobody answers on fails within `timeout_s`, naming the address (ray.init alone
    retries for many minutes)."""
    if ray.is_initialized():
        current = ray.get_runtime_context().namespace
        if current != namespace:
            raise RuntimeError(f"this process is connected to Ray namespace {current!r}, not {namespace!r}")
        return
    _reachable(address, timeout_s)
    ray.init(address=address, namespace=namespace, logging_level="WARNING", log_to_driver=False)


def stdout_for_the_answer() -> TextIO:
    """For a command that talks to Ray: returns the real stdout, for the command's answer alone
    (`--json` is parsed by tools), and points `sys.stdout` at stderr for the rest of this
    process. Ray's driver prints other processes' task failures ("(raylet) Task X failed. There
    are N retries remaining ...", e.g. a health check of an actor being stopped) to `sys.stdout`
    from a thread of its own, whatever `log_to_driver` says, until the process leaves Ray at its
    exit: they, and anything else printed by habit, go to stderr. (The CLI is one command a
    process; a caller running commands in its own process restores `sys.stdout` after each.)"""
    answer = sys.stdout
    sys.stdout = sys.stderr
    return answer


def _reachable(address: str, timeout_s: float) -> None:
    """RuntimeError unless a TCP connection to a HOST:PORT address opens within `timeout_s`
    ("auto" and `ray://` addresses are left to Ray)."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"Ray address {address!r}: expected HOST:PORT (the head's GCS, port 6379 by default) or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else exc.strerror or type(exc).__name__
        raise RuntimeError(f"no Ray cluster at {address} ({reason} within {timeout_s:g} s): "
                           "is the head running, and is this its GCS address (`ray status` on it)?") from None


def _existing(name: str) -> Any | None:
    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def _detached(cls: type, name: str, config: ClusterConfig, retry_calls: bool = True, **options: Any) -> Any:
    """A named, detached actor that Ray restarts in place when its process dies. With
    `retry_calls`, a call in flight when it died runs again on the restarted actor (its methods
    are safe to repeat); without, the caller sees the error and decides (the router, for workers)."""
    retries = config.max_restarts if retry_calls else 0
    return ray.remote(cls).options(name=name, lifetime="detached", max_restarts=config.max_restarts,
                                   max_task_retries=retries, **options)


def start_directory(config: ClusterConfig) -> Any:
    return _existing(DIRECTORY) or _detached(ClusterDirectory, DIRECTORY, config, num_cpus=0).remote(
        health_interval_s=config.watch_interval_s)


def start_shard(name: str, config: ClusterConfig, **options: Any) -> Any:
    """The shard actor `name` (created unless alive); `options` are Ray actor options (placement)."""
    s = config.shard
    options.setdefault("num_cpus", s.num_cpus)
    if s.resources:
        options.setdefault("resources", dict(s.resources))
    return _existing(name) or _detached(StoreShard, name, config, max_concurrency=8, **options).remote(
        name, s, config.kv_events, config.workers + member_index(name))


def start_worker(name: str, config: ClusterConfig, **options: Any) -> Any:
    """The worker actor `name` (created unless alive), holding `worker.num_gpus` GPUs."""
    w = config.worker
    options.setdefault("num_cpus", w.num_cpus)
    options.setdefault("num_gpus", w.num_gpus)
    if w.resources:
        options.setdefault("resources", dict(w.resources))
    return _existing(name) or _detached(CacheWorker, name, config, retry_calls=False, max_concurrency=4,
                                        **options).remote(name, w, config.shard, config.watch_interval_s,
                                                          config.kv_events, member_index(name))


def start_router(config: ClusterConfig) -> Any:
    from tiered_cache.workers.router import PrefixRouter

    return _existing(ROUTER) or _detached(PrefixRouter, ROUTER, config, num_cpus=0, max_concurrency=64).remote(
        config.router)


def _shard_group(config: ClusterConfig, progress: Progress) -> Any:
    """The shards' placement group: one bundle per shard, one shard per node where the cluster
    has nodes enough (STRICT_SPREAD), else spread as far as they go (SPREAD)."""
    name = placement_group_name(config.namespace)
    try:
        group = get_placement_group(name)
    except ValueError:
        group = None
    if group is not None and len(group.bundle_specs) != config.shards:
        raise ValueError(f"placement group {name!r} has {len(group.bundle_specs)} shard bundles but the config "
                         f"asks for {config.shards}: run `tiered-cache cluster stop` first")
    if group is None:
        strategy, why = shard_strategy(config.shards, sum(n["Alive"] for n in ray.nodes()))
        progress(f"{config.shards} store shard(s): {why}")
        bundle = {"CPU": config.shard.num_cpus, **config.shard.resources}
        group = placement_group([dict(bundle) for _ in range(config.shards)], strategy=strategy, name=name,
                                lifetime="detached")
    try:
        ray.get(group.ready(), timeout=config.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(f"the {config.shards} store shard(s) were not placed within {config.start_timeout_s:.0f} s: "
                           f"each asks for {config.shard.num_cpus:g} CPU(s) and {dict(config.shard.resources)} "
                           "(see `ray status`)") from None
    return group


def _await_started(actors: dict[str, Any], config: ClusterConfig, progress: Progress) -> None:
    """Wait until every actor answers, saying what it waits for every `PROGRESS_S`; past
    `config.start_timeout_s` the actors still waiting are killed (a pending GPU actor would
    otherwise hold its place in Ray's queue forever) and RuntimeError names them and why."""
    pending = {actor.ping.remote(): name for name, actor in actors.items()}
    deadline = time.monotonic() + config.start_timeout_s
    while pending:
        left = deadline - time.monotonic()
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=max(0.0, min(PROGRESS_S, left)))
        for ref in done:
            name = pending.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                raise RuntimeError(f"{name} failed to start: {_cause(exc)}") from None
        if not pending:
            return
        waiting = sorted(pending.values())
        workers = sum(n.startswith(WORKER_PREFIX) for n in waiting)
        node_gpus = [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["Alive"]]
        free = ray.available_resources().get("GPU", 0.0)
        if time.monotonic() >= deadline:
            for name in waiting:
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(name), no_restart=True)
            raise RuntimeError(start_timeout_message(waiting, config.start_timeout_s, config.worker.num_gpus,
                                                     workers, node_gpus, free))
        asks = f"; workers ask for {config.worker.num_gpus:g} GPU(s) each, {free:g} of {sum(node_gpus):g} free" \
            if workers and config.worker.num_gpus else ""
        progress(f"waiting for {', '.join(waiting)}{asks}")


def _cause(exc: Exception) -> str:
    """The last line of the error an actor's constructor raised (Ray wraps it in its traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "Error: " in line or "Exception: " in line]
    return (errors or lines or [type(exc).__name__])[-1]


def start(config: ClusterConfig, progress: Progress = lambda _: None) -> list[dict[str, Any]]:
    """Create whatever of directory, shards, workers and router is not running; wait until every
    one answers. Returns each actor's info."""
    workers = config.workers if config.engine is EngineName.HF else 0
    asked = config.shards * config.shard.num_cpus + workers * config.worker.num_cpus
    total = ray.cluster_resources().get("CPU", 0.0)
    if asked > total:  # no autoscaler: this would only wait, then time out
        progress(f"the shards and workers ask for {asked:g} CPU(s), the cluster has {total:g}: waiting up to "
                 f"{config.start_timeout_s:.0f} s for nodes to join (lower --shards/--workers, or add nodes)")
    before = set(actor_names())
    try:
        return _start(config, progress)
    except BaseException:  # a start that fails (or is interrupted) leaves what was running, only
        _remove_new(before, config.namespace, progress)
        raise


def _remove_new(before: set[str], namespace: str, progress: Progress) -> None:
    """Kill the actors of this cluster that were not running before a start that failed, and the
    shards' placement group when none of its shards were."""
    new = [n for n in actor_names() if n not in before]
    for name in sorted(new, key=_kind_order, reverse=True):
        with contextlib.suppress(ValueError, ray.exceptions.RayError):
            ray.kill(ray.get_actor(name), no_restart=True)
    if not any(n.startswith(SHARD_PREFIX) for n in before):
        with contextlib.suppress(ValueError):
            remove_placement_group(get_placement_group(placement_group_name(namespace)))
    if new:
        progress(f"stopped what this start had started: {', '.join(sorted(new, key=_kind_order))}")


def _start(config: ClusterConfig, progress: Progress) -> list[dict[str, Any]]:
    start_directory(config)
    actors: dict[str, Any] = {}
    if config.shards:
        group = _shard_group(config, progress)
        for i in range(config.shards):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)
            actors[shard_name(i)] = start_shard(shard_name(i), config, scheduling_strategy=strategy)
        _await_started(actors, config, progress)  # workers find them registered
    if config.engine is EngineName.VLLM:  # the vLLM replicas come after, through Ray Serve (serve_vllm)
        return [ray.get(a.info.remote()) for a in actors.values()]
    gpus = f", {config.worker.num_gpus:g} GPU(s) each" if config.worker.num_gpus else ""
    names = [worker_name(i) for i in range(config.workers)]
    new = sum(_existing(n) is None for n in names)
    if new:
        progress(f"{new} cache worker(s) loading {config.worker.model}{gpus} ...")
    if new < len(names):
        progress(f"{len(names) - new} cache worker(s) running already: kept as they are")
    workers = {name: start_worker(name, config) for name in names}
    _await_started(workers, config, progress)
    actors.update(workers)
    actors[ROUTER] = start_router(config)
    _await_started({ROUTER: actors[ROUTER]}, config, progress)
    return [ray.get(a.info.remote()) for a in actors.values()]


def actor_names() -> list[str]:
    """Names of this cluster's live named actors in the current namespace."""
    return sorted(n for n in ray.util.list_named_actors() if is_ours(n))


def _kind_order(name: str) -> tuple[int, str]:
    order = {DIRECTORY: 0, ROUTER: 3}
    return order.get(name, 1 if name.startswith(SHARD_PREFIX) else 2), name


def stats(timeout_s: float = 30.0) -> dict[str, Any]:
    """Every shard's and worker's own figures, plus cluster totals per tier (see `rollup`), and
    the directory and router (`control`); each with how often Ray restarted it."""
    names = [n for n in actor_names() if n.startswith((SHARD_PREFIX, WORKER_PREFIX))]
    refs = {n: ray.get_actor(n).stats.remote() for n in names}
    actors = []
    for name in sorted(refs, key=_kind_order):
        try:
            actors.append(ray.get(refs[name], timeout=timeout_s))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            actors.append({"kind": "shard" if name.startswith(SHARD_PREFIX) else "worker", "name": name,
                           "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
        actors[-1]["restarts"] = restarts(name)
    control = [{"kind": name, "name": name, "restarts": restarts(name)}
               for name in (DIRECTORY, ROUTER) if _existing(name) is not None]
    for entry in control:
        if entry["name"] == ROUTER:  # its policy, routes, reasons, failures (and the event policy's fallbacks)
            entry["figures"] = _router_figures(timeout_s)
    figures = {"actors": actors, "control": control, "totals": rollup(actors)}
    vllm = _vllm_stats(ray.get_runtime_context().namespace, timeout_s)
    if vllm is not None:
        figures["vllm"] = vllm
    return figures


def _router_figures(timeout_s: float) -> dict[str, Any]:
    """The router actor's own figures (`PrefixRouter.stats`), or why they cannot be read."""
    try:
        figures = dict(ray.get(ray.get_actor(ROUTER).stats.remote(), timeout=timeout_s))
    except (ValueError, ray.exceptions.RayError, TimeoutError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    figures.pop("kind", None)
    figures.pop("name", None)
    return figures


def _vllm_stats(namespace: str, timeout_s: float) -> dict[str, Any] | None:
    """`cluster start --engine vllm`'s application: its router's stats; None when none runs."""
    from tiered_cache.workers.serve_llm.app import serve_stats

    try:
        return serve_stats(namespace, timeout_s)
    except ImportError:  # Ray without Serve: none can run
        return None
    except Exception as exc:  # a figure that cannot be read is shown as unreachable, never a failed command
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}


def restarts(name: str) -> int | None:
    """How often Ray restarted the named actor in place (the GCS's actor table); None if unknown."""
    from ray._private import state  # the actor table has no public accessor that needs no dashboard

    handle = _existing(name)
    if handle is None:
        return None
    try:
        return int(state.actors(actor_id=handle._actor_id.hex()).get("NumRestarts", 0))
    except Exception:  # a private API: a figure that cannot be read is shown as unknown
        return None


_SUMMED = ("capacity_bytes", "used_bytes", "pages", "hits", "misses", "evictions", "loads", "demotions",
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
             timeout_s: float = 600.0, token: str | None = None) -> dict[str, Any]:
    """One request through the router (the worker it chose, why, and the worker's answer); with
    `engine: vllm`, through the vLLM application's front end (`token`: its bearer token)."""
    router = _existing(ROUTER)
    if router is None:
        from tiered_cache.workers.serve_llm.ask import ask

        return ask(ray.get_runtime_context().namespace, prompt, max_new_tokens, use_cache, token, timeout_s)
    return ray.get(router.generate.remote(prompt, max_new_tokens, use_cache), timeout=timeout_s)


def stop(namespace: str, progress: Progress = lambda _: None, timeout_s: float = 60.0) -> list[str]:
    """Shut every actor down (shards flush RAM to disk first), kill it, remove the placement group,
    and wait until no named actor of the cluster is left. Returns the names stopped."""
    if stop_http(namespace):
        progress("stopped the HTTP front end")
    if stop_vllm(namespace):
        progress("stopped the vLLM replicas and their front end")
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


def serve_http(config: ClusterConfig, host: str, port: int, token: str | None) -> str:
    """Deploy the OpenAI-compatible front end (workers/http_frontend.py) in front of the router;
    returns its base URL."""
    from tiered_cache.workers.http_frontend import deploy

    return deploy(config.namespace, config.worker.model, host, port, token)


def stop_http(namespace: str) -> bool:
    """Delete this cluster's HTTP front end, and Ray Serve with it when no other application is
    left. False when there was none (Serve is not installed, or not running)."""
    return _delete_serve_app(http_app_name(namespace))


def serve_vllm(config: ClusterConfig, shards: list[str], host: str, port: int, token: str | None) -> str:
    """Deploy the Ray Serve LLM application (workers/serve_llm/app.py) over `shards`; returns its
    base URL once every replica runs."""
    from tiered_cache.workers.serve_llm.app import deploy

    return deploy(config, shards, host, port, token)


def stop_vllm(namespace: str) -> bool:
    """Delete the vLLM application of `cluster start --engine vllm`; False when none runs."""
    return _delete_serve_app(serve_llm_app_name(namespace))


def _delete_serve_app(name: str) -> bool:
    try:
        from tiered_cache.workers.http_frontend import delete_app
    except ImportError:  # Ray without Serve: no application can run
        return False
    return delete_app(name)
