"""`TieredCache`: the one object an inference engine talks to.

Device pool (indexed by the radix tree) -> host RAM (decoded pages) -> lower tiers (blobs: disk,
Redis, later a remote store), in that order. Eviction is demotion one tier down; a hit below the
device is promoted back up (into host RAM and the device pool). Everything is single-threaded:
one engine thread drives a cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiered_cache.cache_stats import CacheStats, Movements, PoolFigures
from tiered_cache.config import CacheConfig, LowerTier, WritePolicy
from tiered_cache.device.pool import PagePool, check_tensor
from tiered_cache.errors import PoolExhaustedError
from tiered_cache.index.keys import PageKeyer
from tiered_cache.index.radix import RadixTree
from tiered_cache.index.radix_node import EvictedNode, RadixNode, Tier
from tiered_cache.index.tokens import as_token_array
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.tiers.base import BlobTier, TierStats
from tiered_cache.tiers.codec import BlobError, decode_page, encode_page
from tiered_cache.tiers.host import HostTier
from tiered_cache.tiers.memtune import tune_malloc

_NO_PAGES = np.empty(0, dtype=np.int64)


@dataclass
class CacheHandle:
    """A request's hold on the cache, from `match` to `release`.

    Ownership of device pages: `device_pages` are the prefix's pages, owned by the tree and kept
    alive by the lock on `node`; `own_pages` were allocated for this request's suffix and belong
    to it until `commit` hands the full ones to the tree. `release` frees what it still owns.
    """

    namespace: str
    keys: list[bytes]
    node: RadixNode
    device_pages: np.ndarray
    available_pages: int  # pages found in any tier when matched (device ones included)
    own_pages: list[int] = field(default_factory=list)
    own_tokens: int = 0  # tokens the suffix pages were allocated for
    released: bool = False
    sources: Counter[str] = field(default_factory=Counter)  # tier name -> prefix pages it supplied

    @property
    def num_device_pages(self) -> int:
        return len(self.device_pages)


class TieredCache:
    """KV cache over a device page pool, host RAM and optional lower tiers.

    Tensor API: `put`, `get`, `lookup`. Paged API: `match` -> `load` -> `allocate` -> (engine
    writes K/V with `pool.store`) -> `commit` -> `release`. KV tensors use the shapes of DESIGN.md
    §6; tokens are 1-D integer sequences; `namespace` defaults to the config's.
    """

    def __init__(self, spec: KVSpec, config: CacheConfig | None = None,
                 lower: Sequence[BlobTier] | None = None) -> None:
        self.spec = spec
        self.config = config or CacheConfig()
        if self.config.codec.lossy and spec.dtype is DType.FP8_E4M3:
            raise ValueError("the int8 codec needs fp16, bf16 or fp32 KV")
        if self.config.malloc_tuning:
            tune_malloc()
        self.pool = PagePool.with_capacity(spec, self.config.pool_capacity, self.config.device)
        self.tree = RadixTree(self.config.eviction_policy)
        self.host = HostTier(spec, self.config.host_capacity, on_evict=self._demote_from_host)
        self.lower: list[BlobTier] = list(lower) if lower is not None else self._build_lower_tiers()
        for i, tier in enumerate(self.lower):
            if hasattr(tier, "on_evict"):
                tier.on_evict = self._demoter(i + 1)
        self.moves = Movements()
        self._keyers: dict[str, PageKeyer] = {}
        self._device = TierStats("device", capacity_bytes=self.pool.num_pages * spec.bytes_per_page)
        self._unused_slots = 0
        self._staging_buffer: torch.Tensor | None = None

    def _build_lower_tiers(self) -> list[BlobTier]:
        cfg = self.config
        tiers: list[BlobTier] = []
        for kind in cfg.lower_tiers:
            if kind is LowerTier.DISK:
                from tiered_cache.tiers.disk import DiskTier

                tiers.append(DiskTier(cfg.disk_path or "", cfg.disk_capacity, fsync=cfg.disk_fsync))
            elif kind is LowerTier.REDIS:
                from tiered_cache.tiers.redis import RedisTier

                tiers.append(RedisTier(cfg.redis_url, cfg.redis_prefix, cfg.redis_ttl_s, cfg.redis_timeout_s))
            else:
                from tiered_cache.tiers.remote import RemoteTier

                tiers.append(RemoteTier(cfg.remote_addresses, cfg.remote_token, cfg.remote_tls_ca,
                                        cfg.remote_timeout_s, fingerprint=bytes.fromhex(self.spec.fingerprint)))
        return tiers

    # --- tensor API ------------------------------------------------------------------------------
    def put(self, tokens: Any, kv: torch.Tensor, namespace: str | None = None) -> int:
        """Cache the KV of `tokens` (shape (layers, 2, len(tokens), kv_heads, head_dim)).

        Only full pages are cached. Returns how many tokens were newly stored (pages already
        cached on the device are skipped). Raises KVShapeError, TypeError or ValueError for bad
        input before anything changes.
        """
        ns = self._ns(namespace)
        toks = as_token_array(tokens)
        self._check_kv(kv, len(toks))
        keys = self._keyer(ns).keys(toks)
        match = self.tree.match_prefix(keys, ns)
        n_new = len(keys) - match.num_pages
        if n_new == 0:
            return 0
        self.tree.lock(match.node)  # keep the prefix on the device while room is made
        try:
            pages = self._allocate(n_new)
            ps = self.spec.page_size
            self.pool.store(self.pool.slots(pages, n_new * ps), kv[:, :, match.num_pages * ps:len(keys) * ps])
            self._device.bytes_in += n_new * self.spec.bytes_per_page
            node, _, dup = self._adopt(ns, keys, match.values, pages, Tier.DEVICE)
            self._after_insert(node, keys[match.num_pages + dup:], pages[dup:])
        finally:
            self.tree.unlock(match.node)
        return n_new * ps

    def lookup(self, tokens: Any, namespace: str | None = None) -> int:
        """How many leading tokens are cached in any tier (whole pages; nothing is moved)."""
        ns = self._ns(namespace)
        keys = self._keyer(ns).keys(as_token_array(tokens))
        on_device = self.tree.match_prefix(keys, ns).num_pages
        return (on_device + self._probe_below(keys[on_device:])) * self.spec.page_size

    def get(self, tokens: Any, namespace: str | None = None) -> tuple[int, torch.Tensor]:
        """The longest cached prefix of `tokens`: (n tokens, KV of shape (layers, 2, n, heads, dim)).

        Pages found below the device are promoted (into host RAM and the device pool) first.
        """
        handle = self.match(tokens, namespace)
        try:
            pages = self.load(handle)
            n = len(pages) * self.spec.page_size
            return n, self.pool.read_tokens(pages, n)
        finally:
            self.release(handle)

    # --- paged API -------------------------------------------------------------------------------
    def match(self, tokens: Any, namespace: str | None = None) -> CacheHandle:
        """Find the cached prefix and lock its device pages. Pages found only in lower tiers are
        counted in `available_pages`; `load` brings them to the device."""
        ns = self._ns(namespace)
        keys = self._keyer(ns).keys(as_token_array(tokens))
        result = self.tree.match_prefix(keys, ns)
        self._count_device(result.num_pages, len(keys))
        self.tree.lock(result.node)
        below = self._probe_below(keys[result.num_pages:])
        handle = CacheHandle(ns, keys, result.node, result.values, result.num_pages + below)
        handle.sources["device"] = result.num_pages
        return handle

    def load(self, handle: CacheHandle) -> np.ndarray:
        """Promote the handle's pages found below the device into device pages; returns all the
        prefix's device pages, in order. Pages that turn out missing or corrupt end the prefix."""
        self._check_live(handle)
        start = handle.num_device_pages
        wanted = handle.keys[start:handle.available_pages]
        staging = self._fetch_below(wanted, handle.sources)
        if staging is None:
            handle.available_pages = start
            return handle.device_pages
        n = staging.shape[0]
        pages = self._allocate(n)
        self.pool.scatter(pages, staging)
        self._device.bytes_in += n * self.spec.bytes_per_page
        node, all_pages, _ = self._adopt(handle.namespace, handle.keys[:start + n], handle.device_pages, pages,
                                         Tier.DEVICE | Tier.HOST)
        self._move_lock(handle, node)
        handle.device_pages = all_pages
        handle.available_pages = start + n
        return handle.device_pages

    def allocate(self, handle: CacheHandle, num_tokens: int) -> np.ndarray:
        """Room for `num_tokens` more tokens after those the handle already has pages for: fills the
        free slots of its last page first, then allocates new device pages (evicting if needed).
        Returns only the new pages. Raises PoolExhaustedError when eviction cannot make room."""
        self._check_live(handle)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must not be negative, got {num_tokens}")
        needed = self.spec.pages_for_tokens(handle.own_tokens + num_tokens) - len(handle.own_pages)
        pages = self._allocate(max(0, needed))
        self._unused_slots -= self._handle_unused(handle)
        handle.own_pages.extend(pages.tolist())
        handle.own_tokens += num_tokens
        self._unused_slots += self._handle_unused(handle)
        return pages

    def commit(self, handle: CacheHandle, tokens: Any) -> int:
        """Insert the full pages of `tokens` (the prefix and the suffix the engine wrote into the
        handle's own pages). Returns the number of tokens newly cached."""
        self._check_live(handle)
        keys = self._keyer(handle.namespace).keys(as_token_array(tokens))
        start = handle.num_device_pages
        if keys[:start] != handle.keys[:start]:
            raise ValueError("commit() tokens do not start with the prefix this handle matched")
        n_new = min(len(keys) - start, len(handle.own_pages))
        if n_new <= 0:
            return 0
        new_pages = np.array(handle.own_pages[:n_new], dtype=np.int64)
        self._unused_slots -= self._handle_unused(handle)
        del handle.own_pages[:n_new]  # from here on the tree owns them (or they are freed as duplicates)
        handle.own_tokens = max(0, handle.own_tokens - n_new * self.spec.page_size)
        self._unused_slots += self._handle_unused(handle)
        node, all_pages, dup = self._adopt(handle.namespace, keys[:start + n_new], handle.device_pages,
                                           new_pages, Tier.DEVICE)
        self._after_insert(node, keys[start + dup:start + n_new], new_pages[dup:])
        self._move_lock(handle, node)
        handle.keys, handle.device_pages = keys, all_pages
        return (n_new - dup) * self.spec.page_size

    def release(self, handle: CacheHandle) -> None:
        """Unlock the prefix and free the pages the handle still owns (e.g. a partial last page)."""
        self._check_live(handle)
        self.tree.unlock(handle.node)
        self._unused_slots -= self._handle_unused(handle)
        if handle.own_pages:
            self.pool.free(np.array(handle.own_pages, dtype=np.int64))
        handle.own_pages.clear()
        handle.released = True

    def evict(self, num_pages: int | None = None) -> int:
        """Move up to `num_pages` unlocked device pages (all when None) down to host RAM, least
        recently used first, freeing them in the pool. Returns how many pages were moved."""
        evicted = self.tree.evict(self.tree.size_info().evictable if num_pages is None else num_pages)
        self._demote_from_device(evicted)
        return sum(len(node.keys) for node in evicted)

    # --- statistics ------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        usage = self.pool.usage()
        size = self.tree.size_info()
        device = self._device
        device.pages, device.used_bytes = size.total, size.total * self.spec.bytes_per_page
        tiers = [device, self.moves.apply(self.host.stats())]
        tiers += [self.moves.apply(t.stats()) for t in self.lower]
        pool = PoolFigures(usage.total_pages, usage.used_pages, usage.free_pages, usage.page_bytes,
                           self._unused_slots)
        return CacheStats(tiers, pool, self.spec.page_size, self.tree.num_nodes, size.evictable, size.protected)

    def close(self) -> None:
        """Close the lower tiers' connections (Redis clients, gRPC channels, helper threads)."""
        for tier in self.lower:
            close = getattr(tier, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_integrity(self) -> None:
        """Tree and pool invariants, and every tree page allocated in the pool."""
        self.tree.check_integrity()
        self.pool.check_integrity()
        held = self.tree.size_info().total
        if held > self.pool.usage().used_pages:
            raise AssertionError(f"the tree holds {held} pages but only {self.pool.usage().used_pages} are in use")

    # --- ownership ---------------------------------------------------------------------------------
    def _adopt(self, ns: str, keys: list[bytes], prefix_pages: np.ndarray, new_pages: np.ndarray,
               residency: Tier) -> tuple[RadixNode, np.ndarray, int]:
        """Insert `keys` held in `prefix_pages` + `new_pages` and hand the new pages to the tree.

        Another request may have cached some of the same pages meanwhile (two handles that
        matched the same prefix): the tree keeps its copies and the duplicates are freed here.
        Returns the node ending at the last key, the tree's pages for all keys, and the number
        of duplicates (the leading new pages the tree already had).
        """
        inserted = self.tree.insert(keys, np.concatenate([prefix_pages, new_pages]), ns, residency)
        dup = inserted.num_existing - len(prefix_pages)
        if dup <= 0:
            return inserted.node, np.concatenate([prefix_pages, new_pages]), 0
        self.pool.free(new_pages[:dup])
        result = self.tree.match_prefix(keys, ns)
        assert result.num_pages == len(keys)
        return result.node, result.values, dup

    def _move_lock(self, handle: CacheHandle, node: RadixNode) -> None:
        self.tree.lock(node)
        self.tree.unlock(handle.node)
        handle.node = node

    # --- movement between tiers ------------------------------------------------------------------
    def _allocate(self, n: int) -> np.ndarray:
        shortfall = n - self.pool.num_free
        if shortfall > 0:
            self._demote_from_device(self.tree.evict(shortfall))
        if not self.pool.can_allocate(n):
            raise PoolExhaustedError(n, self.pool.num_free, self.pool.num_pages)
        return self.pool.allocate(n)

    def _demote_from_device(self, evicted: list[EvictedNode]) -> None:
        if not evicted:
            return
        keys = [k for node in evicted for k in node.keys]
        pages = np.concatenate([node.values for node in evicted])
        missing = [i for i, k in enumerate(keys) if k not in self.host.index]
        if missing:
            staging = self.pool.gather(pages[missing], out=None).to("cpu")
            stored = self.host.put([keys[i] for i in missing], staging)
            self.moves.demotions["host"] += stored
            self._device.bytes_out += len(missing) * self.spec.bytes_per_page
        self.pool.free(pages)
        self._device.evictions += len(keys)

    def _demote_from_host(self, keys: list[bytes], pages: torch.Tensor) -> None:
        if self.lower:
            self._put_below(0, [(k, self._encode(p, k)) for k, p in zip(keys, pages, strict=True)])

    def _demoter(self, index: int) -> Any:
        def demote(items: list[tuple[bytes, bytes]]) -> None:
            if index < len(self.lower):
                self._put_below(index, items)
        return demote

    def _put_below(self, index: int, items: list[tuple[bytes, bytes]]) -> None:
        tier = self.lower[index]
        self.moves.demotions[tier.name] += tier.put(items)

    def _after_insert(self, node: RadixNode, keys: list[bytes], pages: np.ndarray) -> None:
        """Write-through copies new pages to host RAM and every lower tier at once."""
        if self.config.write_policy is not WritePolicy.WRITE_THROUGH:
            return
        staging = self.pool.gather(pages).to("cpu")
        self.host.put(keys, staging)
        if self.lower:
            blobs = [(k, self._encode(p, k)) for k, p in zip(keys, staging, strict=True)]
            for tier in self.lower:
                tier.put(blobs)
        self.tree.set_residency(node, node.residency | Tier.HOST)

    def _probe_below(self, keys: list[bytes]) -> int:
        """Leading pages of `keys` held below the device, page runs from any tier in turn."""
        tiers: list[Any] = [self.host, *self.lower]
        pos = 0
        while pos < len(keys):
            for tier in tiers:
                run = tier.contains_prefix(keys[pos:])
                if run:
                    pos += run
                    break
            else:
                break
        return pos

    def _fetch_below(self, keys: list[bytes], sources: Counter[str]) -> torch.Tensor | None:
        """Page-first staging of the leading `keys` found below the device, promoting lower-tier
        hits into host RAM, counting pages per supplying tier in `sources`. Stops at the first
        page no tier can supply intact. The staging tensor is the cache's reusable buffer: valid
        until the next fetch (the caller copies it into the pool at once)."""
        staging = self._staging(len(keys))
        pos = 0
        while pos < len(keys):
            n, _ = self.host.get(keys[pos:], out=staging[pos:])
            if n:
                self.moves.promotions["host"] += n
                sources["host"] += n
                pos += n
                continue
            n = self._fetch_lower(keys[pos:], staging[pos:], sources)
            if not n:
                break
            pos += n
        return staging[:pos] if pos else None

    def _fetch_lower(self, keys: list[bytes], out: torch.Tensor, sources: Counter[str]) -> int:
        """Decode the leading run of `keys` one lower tier holds straight into `out` (page-first)
        and promote those pages into host RAM; returns how many pages."""
        raw = out.view(torch.uint8).reshape(out.shape[0], -1).numpy()
        for tier in self.lower:
            run = tier.contains_prefix(keys)
            if not run:
                continue
            n = 0
            for key, blob in zip(keys[:run], tier.get(keys[:run]), strict=True):
                if not self._decode_into(tier, key, blob, raw[n]):
                    break
                n += 1
            if n:
                self.moves.promotions[tier.name] += n
                sources[tier.name] += n
                self.host.put(keys[:n], out[:n])  # promotion into host RAM
                return n
        return 0

    def _staging(self, num_pages: int) -> torch.Tensor:
        """A page-first host buffer of at least `num_pages` pages, kept and reused: fresh memory
        costs first-touch page faults (0.2-0.7 GiB/s here) on every load otherwise."""
        if self._staging_buffer is None or self._staging_buffer.shape[0] < num_pages:
            size = max(num_pages, 2 * (0 if self._staging_buffer is None else self._staging_buffer.shape[0]))
            self._staging_buffer = torch.zeros(self.spec.staging_shape(size), dtype=self.spec.dtype.torch)
        return self._staging_buffer[:num_pages]

    def _encode(self, page: torch.Tensor, key: bytes) -> bytes:
        return encode_page(page, self.spec, key, self.config.codec, self.config.codec_min_saving)

    def _decode_into(self, tier: Any, key: bytes, blob: bytes | None, out: np.ndarray) -> bool:
        """Decode `blob` into `out` (one page's bytes); a bad blob is counted, deleted, and False."""
        if blob is None:
            return False
        try:
            # NOTE: a BlobTier verifies the checksum of every blob it returns (DESIGN.md §7).
            decode_page(blob, self.spec, key, out=out, check_crc=False)
        except BlobError:
            self.moves.refused[tier.name] += 1
            tier.delete([key])
            return False
        return True

    # --- small helpers ---------------------------------------------------------------------------
    def _ns(self, namespace: str | None) -> str:
        ns = self.config.namespace if namespace is None else namespace
        if not isinstance(ns, str):
            raise TypeError(f"namespace must be a str, got {type(ns).__name__}")
        return ns

    def _keyer(self, namespace: str) -> PageKeyer:
        keyer = self._keyers.get(namespace)
        if keyer is None:
            keyer = self._keyers[namespace] = PageKeyer(self.spec, namespace)
        return keyer

    def _check_kv(self, kv: Any, num_tokens: int) -> None:
        """KV in the tensor-API shape (layers, 2, tokens, kv_heads, head_dim) and the spec's dtype."""
        check_tensor("kv", kv, self.spec.kv_shape(num_tokens), self.spec.dtype.torch, self.spec.model_id)

    def _count_device(self, hits: int, wanted: int) -> None:
        self._device.hits += hits
        self._device.misses += wanted - hits

    def _handle_unused(self, handle: CacheHandle) -> int:
        return max(0, len(handle.own_pages) * self.spec.page_size - handle.own_tokens)

    @staticmethod
    def _check_live(handle: CacheHandle) -> None:
        if handle.released:
            raise ValueError("this cache handle was already released")
