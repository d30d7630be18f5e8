"""`BlockStore`: where the vLLM connector keeps blocks (vLLM-free).

A chain of blob tiers: a RAM blob tier (`host_capacity`) in front of the lower tiers a
`CacheConfig` names (disk, Redis, store servers). Saves are encoded and written on a bounded
background queue, to every tier at once (sharing with other instances is the point), so a
forward pass never waits for disk, Redis or gRPC; a full queue drops the save and counts it.
One store per process and configuration: vLLM's scheduler-side and worker-side connectors in one
process (the usual single-GPU engine) share it, so the scheduler sees what the worker saved.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from tiered_cache.config import CacheConfig
from tiered_cache.demotion import BACKGROUND_NICE, BackgroundQueue
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.codec import BlobError, encode_page, page_view
from tiered_cache.tiers.factory import build_lower_tiers
from tiered_cache.tiers.memory import MemoryTier
from tiered_cache.tiers.memtune import tune_malloc

_STORES: dict[tuple[str, str], BlockStore] = {}
_STORES_LOCK = threading.Lock()


class BlockStore:
    def __init__(self, spec: KVSpec, config: CacheConfig) -> None:
        self.spec = spec
        self.config = config
        if config.malloc_tuning:
            tune_malloc()  # else every fetch pays first-touch page faults on fresh buffers
        tiers = [MemoryTier(config.host_capacity), *build_lower_tiers(config, spec.fingerprint)]
        self.chain = TierChain(tiers)
        self.writer = BackgroundQueue("vllm-block-saver", capacity=config.demotion_queue, nice=BACKGROUND_NICE)
        self._keyers: dict[str, PageKeyer] = {}
        self._lock = threading.Lock()
        self.saves_dropped = 0  # blocks whose save was dropped: the queue was full
        self.load_errors = 0  # blocks found but refused on decode (counted, then recomputed)

    @classmethod
    def shared(cls, spec: KVSpec, config: CacheConfig) -> BlockStore:
        key = (spec.fingerprint, repr(sorted(config.to_dict().items())))
        with _STORES_LOCK:
            store = _STORES.get(key)
            if store is None:
                store = _STORES[key] = cls(spec, config)
            return store

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        """Page keys of the full blocks of `tokens` (a partial last block has none)."""
        with self._lock:
            keyer = self._keyers.get(namespace)
            if keyer is None:
                keyer = self._keyers[namespace] = PageKeyer(self.spec, namespace)
        return keyer.keys(np.asarray(tokens, dtype=np.int64))

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` some tier holds."""
        where = self.chain.locate(keys, leading=True)
        return next((i for i, w in enumerate(where) if w is None), len(where))

    def load(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Each key's page (layers, 2, heads, block_size, dim), or None when it is missing or refused
        on decode (the caller must not use that block). A raw page is a view into its blob: no copy."""
        shape = self.spec.staging_shape(1)[1:]
        out: list[torch.Tensor | None] = []
        for key, blob in zip(keys, self.chain.fetch(list(keys)), strict=True):
            if blob is None:
                out.append(None)
                continue
            try:
                flat = page_view(blob, self.spec, key, check_crc=False)  # the tier verified it
            except BlobError:
                self.load_errors += 1
                out.append(None)
                continue
            with warnings.catch_warnings():  # a read-only view: only ever read from
                warnings.simplefilter("ignore", UserWarning)
                out.append(torch.from_numpy(flat).view(self.spec.dtype.torch).view(shape))
        return out

    def save(self, keys: Sequence[bytes], pages: torch.Tensor) -> bool:
        """Queue `pages` (a copy the caller no longer touches) to be encoded and written below."""
        if not keys:
            return True
        if self.writer.submit(self._write, list(keys), pages):
            return True
        self.saves_dropped += len(keys)
        return False

    def flush(self, timeout_s: float | None = None) -> bool:
        return self.writer.flush(timeout_s)

    def _write(self, keys: list[bytes], pages: torch.Tensor) -> None:
        cfg = self.config
        items = [(k, encode_page(p, self.spec, k, cfg.codec, cfg.codec_min_saving)) for k, p in zip(keys, pages,
                                                                                                   strict=True)]
        for index in range(len(self.chain.tiers)):
            self.chain.put(items, index)
