"""The Ray Serve LLM application of `cluster start --engine vllm`: `llm_config` says what each vLLM
replica runs (the model, CPU or GPUs, our connector over the cluster's shards, the request
router), `deploy` starts it behind our front end (ingress.py); `cluster stop` deletes it.

On the CPU (vLLM's CPU build) each replica is a Serve replica actor, an engine-core process and a
worker process; Ray Serve LLM forces vLLM's multiprocess executor there, so a replica's connector
has a scheduler side and a worker side in two processes, and they share only the store.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tiered_cache.tiers.base import Tier
from tiered_cache.workers.config import ClusterConfig
from tiered_cache.workers.names import SERVE_LLM_INGRESS, serve_llm_app_name
from tiered_cache.workers.serve_llm.settings import CPU_BLOCK_SIZE, ServeRouter, VllmSettings
from tiered_cache.workers.serve_llm.shard_list import NAMESPACE_ENV, shard_list_path

ROUTER_CLASSES = {
    ServeRouter.TIERED_CACHE: "tiered_cache.workers.serve_llm.request_router:TieredCacheRouter",
    ServeRouter.PREFIX: "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
}


def model_source(model: str) -> str:
    """What vLLM loads: the bundled SmolLM2's converted folder, a local folder, or a hub id."""
    if model == "smollm2":
        from tiered_cache.integrations.smollm2 import model_folder

        return str(model_folder())
    folder = Path(model).expanduser()
    return str(folder) if folder.exists() else model


def connector_config(config: ClusterConfig, shards: list[str]) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for our connector: host RAM in each engine process, the
    cluster's shards below it, with the shards' token and CA."""
    extra: dict[str, Any] = {"host_capacity": config.vllm.host_capacity}
    if shards:
        # The shards at deploy time, then the list the replicas keep from the directory (shard_list.py).
        extra.update(lower_tiers=[Tier.REMOTE.value], remote_addresses=list(shards),
                     remote_addresses_file=str(shard_list_path(config.namespace)))
        if config.shard.token:
            extra["remote_token"] = config.shard.token
        if config.shard.tls_ca:
            extra["remote_tls_ca"] = config.shard.tls_ca
    else:
        extra["lower_tiers"] = []
    # No module path: the package's vLLM plugin entry point registers the connector by name.
    return {"kv_connector": "TieredCacheConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def engine_args(config: ClusterConfig, shards: list[str]) -> dict[str, Any]:
    """vLLM's engine arguments for each replica: `shards` are the store shards' HOST:PORT."""
    v = config.vllm
    cpu = not v.num_gpus
    engine: dict[str, Any] = {"max_model_len": v.max_model_len, "enable_prefix_caching": True,
                              "enable_prompt_tokens_details": True, "seed": 0}
    if v.dtype != "auto" or cpu:
        engine["dtype"] = "float32" if v.dtype == "auto" else v.dtype
    if cpu:
        engine["enforce_eager"] = True  # no graphs to capture on the CPU: starts in seconds less
    elif v.num_gpus > 1:
        engine["tensor_parallel_size"] = int(v.num_gpus)  # Ray Serve LLM places one GPU bundle per rank
    if v.block_size or cpu:
        engine["block_size"] = v.block_size or CPU_BLOCK_SIZE
    if v.connector:
        engine["kv_transfer_config"] = connector_config(config, shards)
        # The replica hints its workers to start loading a routed prompt's blocks (llm_server.py).
        engine["worker_extension_cls"] = "tiered_cache.integrations.vllm.worker_extension.TieredCacheWorkerExtension"
    engine.update(v.engine_kwargs)
    return engine


def llm_config(config: ClusterConfig, shards: list[str], source: str) -> Any:
    """The `LLMConfig` of the replicas: `shards` are the store shards' HOST:PORT, `source` what
    vLLM loads (model_source)."""
    from ray.serve.llm import LLMConfig

    v = config.vllm
    cpu = not v.num_gpus
    engine = engine_args(config, shards)
    deployment: dict[str, Any] = {"max_ongoing_requests": v.max_ongoing_requests}
    if v.max_replicas is not None and v.max_replicas > v.replicas:
        deployment["autoscaling_config"] = {"min_replicas": v.replicas, "initial_replicas": v.replicas,
                                            "max_replicas": v.max_replicas}
    else:
        deployment["num_replicas"] = v.replicas
    if v.router in ROUTER_CLASSES:
        deployment["request_router_config"] = {"request_router_class": ROUTER_CLASSES[v.router],
                                               "request_router_kwargs": _router_kwargs(config, source),
                                               # how soon a new replica's event endpoint reaches the router
                                               "request_routing_stats_period_s": 2}
    return LLMConfig(model_loading_config={"model_id": model_id(v), "model_source": source},
                     server_cls="tiered_cache.workers.serve_llm.llm_server:TieredCacheLLMServer",
                     accelerator_config={"kind": "cpu"} if cpu else None,
                     engine_kwargs=engine, deployment_config=deployment,
                     runtime_env={"env_vars": _engine_env(v, config.namespace if v.connector and shards else None)},
                     experimental_configs={"KV_EVENTS_PORT_BASE": v.events_port,
                                           "KV_TOKEN_PORT_BASE": v.token_port})


def model_id(settings: VllmSettings) -> str:
    """The `model` a request names: the setting as given (a folder's name, not its path)."""
    return Path(settings.model).name if "/" in settings.model and Path(settings.model).expanduser().exists() \
        else settings.model


def _router_kwargs(config: ClusterConfig, source: str) -> dict[str, Any]:
    """Our router's: the tokenizer, and the Ray namespace of the cluster's directory (its shards)."""
    if config.vllm.router is not ServeRouter.TIERED_CACHE:
        return {}
    return {"model": source, "namespace": config.namespace}


def _engine_env(settings: VllmSettings, follow_shards_of: str | None) -> dict[str, str]:
    env = {"PYTHONHASHSEED": "0"}  # vLLM's block hashes alike on every replica
    if follow_shards_of is not None:  # the replicas keep the cluster's shard list (shard_list.py)
        env[NAMESPACE_ENV] = follow_shards_of
    if not settings.num_gpus:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, settings.cpu_kv_cache // 2**30))
        # One environment for every replica of a deployment: binding would put every engine on
        # the same cores, so the OS places their threads, a share of the node's cores each.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // settings.replicas))
    return env


def deploy(config: ClusterConfig, shards: list[str], host: str, port: int, token: str | None) -> str:
    """Start Serve's proxy on `host:port` (a token beyond loopback) and the application: the
    vLLM replicas behind our front end. Blocks until every replica runs; returns the base URL."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress
    from ray.serve.llm import build_llm_deployment

    from tiered_cache.workers.http_frontend import base_url, start_proxy
    from tiered_cache.workers.serve_llm.ingress import TieredCacheIngress, ingress_app

    start_proxy(host, port, token)
    llm = llm_config(config, shards, model_source(config.vllm.model))
    ingress = make_fastapi_ingress(TieredCacheIngress, app=ingress_app(token))
    options = {**TieredCacheIngress.get_deployment_options([llm]), "name": SERVE_LLM_INGRESS}
    app = serve.deployment(ingress, **options).bind(
        llm_deployments={llm.model_id: build_llm_deployment(llm)},
        model_cards={llm.model_id: to_model_metadata(llm.model_id, llm)})
    serve.run(app, name=serve_llm_app_name(config.namespace), route_prefix="/")
    return base_url(host, port)


def running(namespace: str) -> bool:
    """Whether the vLLM application of `namespace` runs (Serve's proxy up, the application in its
    status); False on a Ray without Serve."""
    try:
        from ray import serve

        from tiered_cache.workers.http_frontend import running_bind
    except ImportError:
        return False
    return running_bind() is not None and serve_llm_app_name(namespace) in serve.status().applications


def serve_stats(namespace: str, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """The application's request router stats (each replica's connector figures in them) and the
    requests its front end sent again; None when no vLLM application runs in `namespace`."""
    from ray import serve

    if not running(namespace):
        return None
    name = serve_llm_app_name(namespace)
    handle = serve.get_deployment_handle(SERVE_LLM_INGRESS, app_name=name)
    return {"app": name, **handle.tiered_cache_figures.remote().result(timeout_s=timeout_s)}

