"""`bench serve`: one Ray cluster (a store shard, the directory), then each way in turn on the same
workload, deployed, measured and removed:

    a  Ray Serve LLM, power-of-two router, vLLM alone
    b  Ray Serve LLM, PrefixCacheAffinityRouter, vLLM alone
    c  as b, our connector in every engine (the store below)
    d  our connector and our request router
    e  our HF cache workers and our event router (the demo engine), behind our front end

Each vLLM way asks under a cache salt of its own, so no way finds another's blocks (vLLM's
prefix cache and our store both key by it). Run in the vLLM venv (it has Ray Serve).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiered_cache.bench.serve.client import front_end_figures
from tiered_cache.bench.serve.runner import WayRun, run_way
from tiered_cache.bench.serve.workload import ServeWorkload

WAYS = {"a": ("pow2", False), "b": ("prefix", False), "c": ("prefix", True), "d": ("tiered-cache", True)}
WAY_NAMES = {"a": "a: Serve pow2, vLLM", "b": "b: Serve prefix, vLLM", "c": "c: prefix + our connector",
             "d": "d: our router + connector", "e": "e: our HF workers"}
TOKEN = "bench-serve"


@dataclass(frozen=True)
class ServeBenchSettings:
    workload: ServeWorkload
    ways: str = "abcde"
    replicas: int = 2
    max_tokens: int = 16
    port: int = 18260
    address: str | None = None
    namespace: str = "tiered-cache-bench-serve"
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # vLLM arguments for every replica


def bench_serve(settings: ServeBenchSettings, progress: Callable[[str], None] = lambda _: None) -> list[WayRun]:
    import ray

    from tiered_cache.workers import cluster

    if settings.address:
        cluster.connect(settings.address, settings.namespace)
    else:
        ray.init(num_cpus=8, namespace=settings.namespace, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False)
    config = _config(settings)
    requests = settings.workload.requests()
    runs = []
    try:
        infos = cluster.start(config, progress)
        shards = [i["address"] for i in infos if i["kind"] == "shard"]
        for way in settings.ways:
            progress(f"way {WAY_NAMES[way]}: deploying ...")
            url = _deploy(way, config, shards, settings, progress)
            progress(f"way {WAY_NAMES[way]}: {len(requests)} requests at {settings.workload.rate:g}/s ...")
            salt = f"bench-serve-{way}-{settings.workload.seed}" if way in WAYS else None
            runs.append(run_way(WAY_NAMES[way], url, TOKEN, requests, _model(way, config), settings.max_tokens, salt))
            if way in WAYS:
                runs[-1].router = front_end_figures(url, TOKEN)
            _remove(way, config)
    finally:
        cluster.stop(config.namespace)
        if not settings.address:
            ray.shutdown()
    return runs


def _config(settings: ServeBenchSettings) -> Any:
    from tiered_cache.workers.config import ClusterConfig

    return ClusterConfig.from_dict({
        "namespace": settings.namespace, "shards": 1, "workers": settings.replicas, "engine": "vllm",
        "kv_events": "tcp://127.0.0.1:0", "router": {"policy": "events"},
        "shard": {"disk_path": None, "ram_capacity": "1GiB", "host": "127.0.0.1"},
        "worker": {"max_new_tokens": settings.max_tokens},
        "vllm": {"replicas": settings.replicas, "host_capacity": "128MiB", "engine_kwargs": settings.engine_kwargs}})


def engine_arg(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` (`--engine-arg`): VALUE as JSON where it parses (numbers, booleans, objects),
    else the string. ValueError naming the malformed argument."""
    import json

    name, sep, value = (part.strip() for part in text.partition("="))
    if not sep or not name:
        raise ValueError(f"an engine argument is NAME=VALUE (e.g. block_size=128), got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def _model(way: str, config: Any) -> str:
    return config.vllm.model if way in WAYS else config.worker.model


def _deploy(way: str, config: Any, shards: list[str], settings: ServeBenchSettings,
            progress: Callable[[str], None]) -> str:
    from tiered_cache.workers import cluster
    from tiered_cache.workers.config import EngineName

    if way in WAYS:
        router, connector = WAYS[way]
        vllm = dataclasses.replace(config.vllm, router=router, connector=connector)
        return cluster.serve_vllm(config.replace(vllm=vllm), shards, "127.0.0.1", settings.port, TOKEN)
    cluster.start(config.replace(engine=EngineName.HF), progress)
    return cluster.serve_http(config, "127.0.0.1", settings.port, TOKEN)


def _remove(way: str, config: Any) -> None:
    """The way's engines go, the shard and directory stay for the next way."""
    import ray

    from tiered_cache.workers import cluster
    from tiered_cache.workers.names import ROUTER, WORKER_PREFIX

    if way in WAYS:
        cluster.stop_vllm(config.namespace)
        return
    cluster.stop_http(config.namespace)
    for name in cluster.actor_names():
        if name == ROUTER or name.startswith(WORKER_PREFIX):
            ray.kill(ray.get_actor(name), no_restart=True)
