"""tiered-cache: a distributed multi-tier KV cache for LLM inference.

The core (spec, keys, radix tree, allocator) imports without torch; `PagePool` needs torch and is
imported from `tiered_cache.pool`. Ray, CuPy and transformers are only imported where used.
"""

from tiered_cache.keys import PageKeyer, chain_keys, root_key
from tiered_cache.radix import RadixTree
from tiered_cache.radix_node import EvictionPolicy, SizeInfo, Tier
from tiered_cache.spec import DType, KVSpec, Layout

__version__ = "0.1.0"

__all__ = [
    "DType",
    "EvictionPolicy",
    "KVSpec",
    "Layout",
    "PageKeyer",
    "RadixTree",
    "SizeInfo",
    "Tier",
    "chain_keys",
    "root_key",
]
