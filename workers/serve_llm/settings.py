"""`VllmSettings`: the Ray Serve LLM application `cluster start --engine vllm` deploys (the
`vllm:` section of the cluster YAML). Ray-free: the CLI checks a config before it connects."""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.model.units import parse_size

# vLLM's CPU build defaults to 128-token blocks, and a prefix cache (vLLM's and ours) reuses whole
# blocks only: a question on a cached document recomputes the document's last partial block, up to
# 127 tokens. 32 is the smallest its CPU attention is tuned for.
CPU_BLOCK_SIZE = 32
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)  # vLLM's


def engine_missing() -> str | None:
    """Why this Python cannot run the vLLM application (one line), None when it can: vLLM and
    Ray Serve live in their own venv (`make install-vllm`), not the main one."""
    missing = [name for name, module in (("vllm", "vllm"), ("ray[serve]", "ray.serve"))
               if _absent(module)]
    if not missing:
        return None
    return (f"{' and '.join(missing)} not installed in this Python: make install-vllm, then run "
            ".venv-vllm/bin/tiered-cache")


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # its parent package is missing
        return True


class ServeRouter(enum.Enum):
    """Which Ray Serve request router picks a replica for each request."""

    TIERED_CACHE = "tiered-cache"  # ours: expected TTFT from the replicas' KV events (request_router.py)
    PREFIX = "prefix"  # Ray's PrefixCacheAffinityRouter: the prompt's text, matched per replica
    POW2 = "pow2"  # Ray Serve's default: the shorter queue of two replicas drawn at random


def named(kind: type[enum.Enum], value: Any, setting: str) -> Any:
    """`value` as a member of `kind`; ValueError naming the setting and the choices."""
    try:
        return kind(getattr(value, "value", value))
    except ValueError:
        raise ValueError(f"{setting} must be one of {', '.join(str(m.value) for m in kind)}, got {value!r}") from None


@dataclass(frozen=True)
class VllmSettings:
    model: str = "smollm2"  # "smollm2" (the bundled SmolLM2-135M-Instruct) or a local HF model folder
    replicas: int = 2  # replicas at start (autoscaling's floor when max_replicas is above it)
    max_replicas: int | None = None  # None: a fixed number of replicas
    num_gpus: float = 0  # GPUs each replica's engine holds; 0: vLLM's CPU build on the node's cores
    router: ServeRouter = ServeRouter.TIERED_CACHE
    connector: bool = True  # our connector in every engine (False: vLLM's own prefix cache only)
    host_capacity: int = 256 * 2**20  # the connector's host RAM tier, in each engine process
    max_model_len: int = 4096
    dtype: str = "auto"  # "auto": float32 on the CPU, vLLM's choice on a GPU
    cpu_kv_cache: int = 2**30  # vLLM's KV space per replica on the CPU (VLLM_CPU_KVCACHE_SPACE)
    # The replicas' vLLM KV event ports: replica r (its rank on its node) publishes on PORT + r and
    # replays on PORT + 1000 + r; the prompt-token channel Ray opens beside them takes TOKEN_PORT + r.
    events_port: int = 25557
    token_port: int = 27557
    max_ongoing_requests: int = 16  # per replica; past it Serve queues at the ingress
    # Tokens per KV block (vLLM's block_size); None: vLLM's own on a GPU, and CPU_BLOCK_SIZE on the CPU.
    block_size: int | None = None
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)  # more vLLM engine arguments, as given

    def __post_init__(self) -> None:
        object.__setattr__(self, "router", named(ServeRouter, self.router, "vllm.router"))
        for name in ("host_capacity", "cpu_kv_cache"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        if self.replicas < 1:
            raise ValueError(f"vllm.replicas must be 1 or more, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"vllm.max_replicas ({self.max_replicas}) is below vllm.replicas ({self.replicas})")
        if self.num_gpus < 0:
            raise ValueError(f"vllm.num_gpus must be >= 0, got {self.num_gpus}")
        for name in ("events_port", "token_port"):
            port = getattr(self, name)
            if not 1024 <= port <= 64000:
                raise ValueError(f"vllm.{name} must be between 1024 and 64000, got {port}")
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            sizes = ", ".join(map(str, BLOCK_SIZES))
            raise ValueError(f"vllm.block_size must be one of {sizes}, got {self.block_size}")
        if self.cpu_kv_cache < 2**20:
            raise ValueError(f"vllm.cpu_kv_cache must be at least 1 MiB, got {self.cpu_kv_cache}")
