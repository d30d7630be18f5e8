"""Names of the cluster's detached actors inside its Ray namespace: one place, so `start`, `status`,
`stop` and the actors themselves always agree."""

from __future__ import annotations

DIRECTORY = "directory"
ROUTER = "router"
SHARD_PREFIX = "shard-"
WORKER_PREFIX = "worker-"
SHARD_GROUP = "shards"  # the placement group of the shards (prefixed with the namespace)


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index}"


def worker_name(index: int) -> str:
    return f"{WORKER_PREFIX}{index}"


def member_index(name: str) -> int:
    """The index in a shard's or worker's name ("worker-3" -> 3)."""
    return int(name.rpartition("-")[2])


def is_ours(name: str) -> bool:
    return name in (DIRECTORY, ROUTER) or name.startswith((SHARD_PREFIX, WORKER_PREFIX))


def placement_group_name(namespace: str) -> str:
    return f"{namespace}-{SHARD_GROUP}"


def http_app_name(namespace: str) -> str:
    """The Ray Serve application of the cluster's HTTP front end (`cluster start --serve`)."""
    return f"tiered-cache-{namespace}"


def serve_llm_app_name(namespace: str) -> str:
    """The Ray Serve LLM application of `cluster start --engine vllm` (its replicas and front end)."""
    return f"tiered-cache-{namespace}-vllm"


SERVE_LLM_INGRESS = "TieredCacheIngress"  # that application's front end deployment, for a handle to it
ROUTER_STATS_PATH = "/tiered-cache/router"  # the vLLM front end's own figures (its request routers')
ROUTE_HEADER = "x-tiered-cache-route"  # its streamed answers' route, as JSON (their body has no room for it)
