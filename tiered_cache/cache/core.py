"""`CacheCore`: what the parts of one `TieredCache` share, built once, in the order they need.

The pages and where they live: the blob tiers below (`TierChain`), host RAM with its write-behind
to them (`LowerWriter`: host RAM hands it what it drops, so they are made together), the device
pool, its radix tree and the ledger of who holds each device page. What the parts share to work
on them: one lock, the requests in progress (background steps wait for a gap), the movement
counters, the pages on their way below (`in_flight`), the one copier between host RAM and the
pool and the copies of it still running (`host_loads`), the reuse policy every load feeds, the
live histograms when metrics are served, and the KV events the tiers publish.

The parts built on the core take it plus only what is its own (demoter.py, loader.py,
sequences.py, ...); the few the core builds itself take the pieces they use (the ledger, the reuse
gate, the host copies; the writer reads the core through a protocol of its own), so none of their
modules imports this one back. None is wired to another after it is built.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tiered_cache.cache.arguments import as_namespace
from tiered_cache.cache.foreground import PROCESS, Foreground
from tiered_cache.cache.handle import HOST
from tiered_cache.cache.host_loads import HostLoads
from tiered_cache.cache.ledger import PageLedger
from tiered_cache.cache.lower_tiers import build_lower_tiers
from tiered_cache.cache.lower_writer import LowerWriter
from tiered_cache.cache.reuse import ReuseGate
from tiered_cache.cache.stats import Movements
from tiered_cache.config import CacheConfig
from tiered_cache.device.host_copy import HostCopier
from tiered_cache.device.malloc import tune_malloc
from tiered_cache.device.pool import PagePool, check_tensor
from tiered_cache.events.recorder import open_events
from tiered_cache.index.keys import PageKeyer
from tiered_cache.index.radix import RadixTree
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.tiers.base import BlobTier
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.host import HostTier


class CacheCore:
    """The state and services every part of one cache shares (see the module doc)."""

    def __init__(self, spec: KVSpec, config: CacheConfig, lower: Sequence[BlobTier] | None = None) -> None:
        if config.codec.lossy and spec.dtype is DType.FP8_E4M3:
            raise ValueError("the int8 codec needs fp16, bf16 or fp32 KV")
        if config.malloc_tuning:
            tune_malloc()
        self.spec, self.config = spec, config
        # One lock guards tree, pool and host RAM metadata (and host RAM copies, which are memory);
        # lower-tier I/O, encoding and decoding run outside it.
        self.lock = threading.RLock()
        self.foreground = Foreground(PROCESS)
        self.moves = Movements()
        self.demotions_idle = threading.Event()  # set while no demotion is queued or running
        self.demotions_idle.set()
        self.closed = False  # set once the background queues have ended (`TieredCache.close`)
        # Pages host RAM dropped that are queued for the tiers below: served from here until the put is done.
        self.in_flight: dict[bytes, torch.Tensor] = {}
        self.chain = TierChain(list(lower) if lower is not None else build_lower_tiers(config, spec.fingerprint))
        self.writer = LowerWriter(self)
        # Normal tensors even when built under torch.inference_mode(): background threads (not in
        # inference mode) write into the pool and the host slab too.
        with torch.inference_mode(False):
            self.pool = PagePool.with_capacity(spec, config.pool_capacity, config.device)
            self.host = HostTier(spec, config.host_capacity, on_evict=self.writer.host_evicted,
                                 retain=self.writer.retain)
        self.tree = RadixTree(config.eviction_policy)
        self.ledger = PageLedger(spec, self.pool, self.tree, self.host)
        # One copier for every host slab <-> pool copy: its one stream orders loads and demotions of a row.
        self.copier = HostCopier(self.pool)
        self.reuse = ReuseGate(config, self.chain, self.tier_name, spec)
        self.host_loads = HostLoads(self.pool, self.host, self.copier, self.reuse.observe)
        self.live_metrics = _live_metrics(config, self.chain)  # histograms fed as things happen, or None
        self.events = open_events(config, spec.page_size, self.ledger.page_tokens.get)  # KV events, or None
        if self.events is not None:
            self.events.watch(self.tree, self.host, self.chain)
        self._keyer = functools.lru_cache(maxsize=1024)(functools.partial(PageKeyer, spec))  # per namespace

    def namespace(self, namespace: str | None) -> str:
        """`namespace`, or the config's when None; TypeError for anything but a str."""
        return as_namespace(self.config.namespace if namespace is None else namespace)

    def keys(self, namespace: str, tokens: np.ndarray) -> list[bytes]:
        """The page keys of `tokens` (full pages) in `namespace`."""
        return self._keyer(namespace).keys(tokens)

    def tier_name(self, where: int) -> str:
        """The name of the tier a plan entry stands for (HOST or a lower tier's index)."""
        return self.host.name if where == HOST else self.chain.tiers[where].name

    def check_kv(self, kv: Any, num_tokens: int) -> None:
        """KV in the tensor-API shape (layers, 2, tokens, kv_heads, head_dim) and the spec's dtype."""
        check_tensor("kv", kv, self.spec.kv_shape(num_tokens), self.spec.dtype.torch, self.spec.model_id)

    def close(self) -> None:
        """Close the lower tiers' connections and the event publisher (the parts have stopped)."""
        self.chain.close()
        if self.events is not None:
            self.events.close()


def _live_metrics(config: CacheConfig, chain: TierChain) -> Any:
    """The live histograms (`LiveMetrics`) when the cache serves metrics: every get below feeds them."""
    if config.metrics_port is None:
        return None
    from tiered_cache.metrics.live import LiveMetrics

    live = LiveMetrics()
    chain.observe_gets(live.observe_get)
    return live
