"""tiered-cache: a distributed multi-tier KV cache for LLM inference.

The core (spec, keys, radix tree, allocator) imports without torch. `TieredCache`, `CacheConfig`
and `PagePool` are importable from here too, but load torch only when first used. Ray, CuPy and
transformers are only imported where used.
"""

from __future__ import annotations

from typing import Any

from tiered_cache.index.eviction_queue import EvictionPolicy
from tiered_cache.index.keys import PageKeyer, chain_keys, root_key
from tiered_cache.index.radix import RadixTree
from tiered_cache.index.radix_results import SizeInfo
from tiered_cache.model.hf_config import spec_from_hf_config
from tiered_cache.model.presets import preset_spec
from tiered_cache.model.spec import DType, KVSpec, Layout
from tiered_cache.tiers.base import Tier

__version__ = "0.1.0"

# Names that need torch: imported on first access, so `import tiered_cache` stays light.
_LAZY = {
    "TieredCache": "tiered_cache.cache.tiered_cache",
    "CacheHandle": "tiered_cache.cache.handle",
    "CacheConfig": "tiered_cache.config",
    "WritePolicy": "tiered_cache.config",
    "PagePool": "tiered_cache.device.pool",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiered_cache' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "CacheConfig",
    "CacheHandle",
    "DType",
    "EvictionPolicy",
    "KVSpec",
    "Layout",
    "PageKeyer",
    "PagePool",
    "RadixTree",
    "SizeInfo",
    "Tier",
    "TieredCache",
    "WritePolicy",
    "chain_keys",
    "preset_spec",
    "root_key",
    "spec_from_hf_config",
]
