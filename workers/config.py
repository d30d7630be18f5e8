"""`ClusterConfig`: what `tiered-cache cluster start` launches, read from a YAML file (see
`deploy/tiered-cache-cluster.yaml`). Unknown keys are errors, so a typo never silently falls back
to a default. Ray-free: the CLI parses a config before it connects."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_cache.model.units import parse_size
from tiered_cache.wire.auth import check_token
from tiered_cache.workers.kv_events import check_template
from tiered_cache.workers.serve_llm.settings import VllmSettings, named

AUTO_HOST = "auto"  # a shard binds its node's IP address, reachable from the other nodes
DEVICES = ("auto", "cuda", "cpu")
WEIGHT_DTYPES = ("auto", "fp32", "fp16", "bf16")


class EngineName(enum.Enum):
    """What computes the tokens on the cluster's nodes."""

    HF = "hf"  # our CacheWorkers (workers/cache_worker.py): Hugging Face models over our radix-tree cache
    VLLM = "vllm"  # a Ray Serve LLM application: vLLM replicas, our connector in each (workers/serve_llm/)


class RoutingPolicyName(enum.Enum):
    PREFIX = "prefix"  # the worker most likely to hold the longest prefix, bounded by load
    ROUND_ROBIN = "round_robin"
    # Where the workers' and shards' KV events say the pages are, by expected TTFT
    # (routing/event_policy.py); the prefix policy while events are stale.
    EVENTS = "events"


@dataclass(frozen=True)
class ShardSettings:
    ram_capacity: int = 2**30
    disk_path: str | None = "~/.cache/tiered-cache/shards"  # each shard uses <disk_path>/<shard name>
    disk_capacity: int = 10 * 2**30
    redis_url: str | None = None  # an optional Redis tier below disk
    host: str = AUTO_HOST  # "auto": the node's IP; 127.0.0.1 only works on a one-node cluster
    port: int = 0  # 0: a free port, announced through the directory
    token: str | None = None  # bearer token the shards require (workers send it); None: no auth
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # what workers verify the shards' certificates with
    # Ray's scheduling share, not a thread count: a shard mostly waits on its sockets and disk,
    # and two shards and a worker then fit a 2-core machine (`ray start --head` offers 2 CPUs).
    num_cpus: float = 0.5
    resources: Mapping[str, float] = field(default_factory=dict)  # e.g. {"shard_node": 0.01} to pin

    def __post_init__(self) -> None:
        for name in ("ram_capacity", "disk_capacity"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        check_token(self.token, "shard.token")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("shard TLS needs both tls_cert and tls_key")


@dataclass(frozen=True)
class WorkerSettings:
    model: str = "smollm2"  # "smollm2" (the bundled SmolLM2-135M-Instruct) or a local HF model folder
    kv_dtype: str = "auto"  # "auto": the weights' dtype where it is 16-bit (bf16 on a GPU), else fp16
    page_size: int = 16
    pool_capacity: int = 256 * 2**20
    host_capacity: int = 2**30
    max_new_tokens: int = 32
    num_cpus: float = 1
    # GPUs each worker holds. A worker that asks for one waits for it (the autoscaler adds GPU
    # nodes for pending GPU actors) and computes on it: it never falls back to a CPU by itself.
    num_gpus: float = 0
    # Where the worker computes: "auto" (its GPU when it holds one, else the CPU), "cuda" (a GPU,
    # or it refuses to start), "cpu" (the CPU even when it holds a GPU: placement trials on
    # nodes that only advertise GPUs).
    device: str = "auto"
    weights_dtype: str = "auto"  # "auto": bf16 on a GPU, fp32 on a CPU; or fp32, fp16, bf16
    resources: Mapping[str, float] = field(default_factory=dict)
    # The correctness canary (cache/canary.py): the share of cache hits recomputed off the request
    # path and compared with the reused KV (a worker has the model, so it can afford a little).
    verify_fraction: float = 0.01

    def __post_init__(self) -> None:
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"worker.verify_fraction must be between 0 and 1, got {self.verify_fraction}")
        for name in ("pool_capacity", "host_capacity"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        if self.max_new_tokens <= 0 or self.page_size <= 0:
            raise ValueError("worker.max_new_tokens and worker.page_size must be positive")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ValueError(f"worker.num_gpus and worker.num_cpus must be >= 0, got {self.num_gpus} and "
                             f"{self.num_cpus}")
        if self.device not in DEVICES:
            raise ValueError(f"worker.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not self.num_gpus:
            raise ValueError("worker.device: cuda needs worker.num_gpus > 0 (Ray hands GPUs only to those "
                             "who ask)")
        if self.weights_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"worker.weights_dtype must be one of {', '.join(WEIGHT_DTYPES)}, "
                             f"got {self.weights_dtype!r}")


@dataclass(frozen=True)
class RouterSettings:
    policy: RoutingPolicyName = RoutingPolicyName.PREFIX
    cache_threshold: float = 0.5  # a match must cover this share of the prompt to decide the route
    balance_abs_threshold: int = 4  # in-flight requests: imbalance beyond both thresholds ...
    balance_rel_threshold: float = 1.5  # ... sends the request to the least-loaded worker
    retries: int = 2  # other workers tried when the chosen one dies mid-request

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", RoutingPolicyName(getattr(self.policy, "value", self.policy)))


@dataclass(frozen=True)
class ClusterConfig:
    namespace: str = "tiered-cache"  # Ray namespace of the named, detached actors
    shards: int = 2
    workers: int = 2
    watch_interval_s: float = 1.0  # how often workers re-read the shard directory
    # How long `cluster start` waits for every actor to be placed and answer: a GPU node the
    # autoscaler brings takes minutes; past it, start fails naming what is missing.
    start_timeout_s: float = 600.0
    # How often Ray restarts a crashed actor (killed, out of memory, its node lost) in place: same
    # name, same handles, state recovered from the cluster; -1 for no limit, 0 for never.
    max_restarts: int = 10
    # KV events (tiered_cache/events/, workers/kv_events.py): every worker's cache and every shard
    # publishes where its pages are at tcp://HOST:PORT + 2 x its slot (HOST auto: each node's IP;
    # PORT 0: free ports), and the `events` routing policy routes on them. None: off.
    kv_events: str | None = None
    engine: EngineName = EngineName.HF
    shard: ShardSettings = field(default_factory=ShardSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)  # engine hf
    router: RouterSettings = field(default_factory=RouterSettings)  # engine hf
    vllm: VllmSettings = field(default_factory=VllmSettings)  # engine vllm

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", named(EngineName, self.engine, "engine"))
        if self.shards < 0 or self.workers < 0:
            raise ValueError(f"shards and workers must be >= 0, got {self.shards} and {self.workers}")
        if not self.namespace:
            raise ValueError("namespace must not be empty")
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, got {self.start_timeout_s}")
        if self.kv_events is not None:
            check_template(self.kv_events)
        elif self.router.policy is RoutingPolicyName.EVENTS:
            raise ValueError("router.policy events needs kv_events (e.g. tcp://127.0.0.1:0): the router routes "
                             "on the KV events of workers and shards")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be -1 (no limit), 0 or more, got {self.max_restarts}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterConfig:
        """A config from nested mappings; raises ValueError naming any unknown key."""
        nested = {"shard": ShardSettings, "worker": WorkerSettings, "router": RouterSettings, "vllm": VllmSettings}
        values: dict[str, Any] = {}
        for key, value in _known(cls, data, "").items():
            if key in nested:
                value = nested[key](**_known(nested[key], value or {}, f"{key}."))
            values[key] = value
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None

    def replace(self, **changes: Any) -> ClusterConfig:
        return dataclasses.replace(self, **changes)


def _known(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(where + k for k in unknown)}; "
                         f"known: {', '.join(where + k for k in sorted(known))}")
    return {k: v for k, v in data.items() if v is not None or k in _NULLABLE}


# Keys whose YAML `null` means "none" rather than "use the default".
_NULLABLE = {"disk_path", "redis_url", "token", "tls_cert", "tls_key", "tls_ca", "kv_events", "max_replicas"}
