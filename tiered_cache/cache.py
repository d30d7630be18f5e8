"""`TieredCache`: the one object an inference engine talks to.

Device pool (indexed by the radix tree) -> host RAM (decoded pages) -> a `TierChain` of blob
tiers (disk, Redis, remote stores). The request path does only what the request needs:

- `match` walks the tree and asks the tiers below once (host RAM, then each lower tier at most
  once) how far the prefix continues (under `reuse: faster`, only as far as loading beats
  recomputing); `prefetch` starts bringing those pages up in the background and `load` waits
  only for what has not arrived. The load path is `promotion.py`: host RAM slots go straight into
  device pages; a page from below lands in its device page (CPU pool) or in pinned staging, then
  one DMA (CUDA).
- `commit` inserts only pages whose every token was written (`write` / `mark_written`).
- Demotion is write-behind: above `high_watermark` a background thread moves cold pages device ->
  host until `low_watermark`; host RAM evictions are encoded and put below by another background
  thread through a bounded queue (full: dropped and counted). An allocation that finds the pool
  full still evicts inline, but only copies device -> host there.

Thread safety: one lock guards tree, pool and host-RAM metadata (and host-RAM copies, which are
memory); lower-tier I/O, encoding and decoding run outside it. A handle is used by one thread at
a time; several threads may use the cache at once.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch

from tiered_cache.cache_stats import CacheStats, Movements, PoolFigures
from tiered_cache.compaction import CompactionOps
from tiered_cache.config import CacheConfig, WritePolicy
from tiered_cache.demotion import BACKGROUND_NICE, BackgroundQueue, Foreground
from tiered_cache.device.pool import PagePool, check_tensor
from tiered_cache.errors import IntegrityError, PoolExhaustedError
from tiered_cache.forking import ForkOps
from tiered_cache.handle import HOST, CacheHandle
from tiered_cache.index.keys import PageKeyer
from tiered_cache.index.radix import RadixTree
from tiered_cache.index.radix_node import EvictedNode, RadixNode, Tier
from tiered_cache.index.tokens import as_token_array
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.promotion import Fetched, Promoter
from tiered_cache.spare_output import SpareOutput
from tiered_cache.swapping import SwapOps
from tiered_cache.tiers.base import BlobTier, TierStats
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.codec import encode_page
from tiered_cache.tiers.factory import build_lower_tiers
from tiered_cache.tiers.host import HostTier
from tiered_cache.tiers.memtune import tune_malloc
from tiered_cache.tree_view import PageTokens, decode_previews, snapshot

_NO_PAGES = np.empty(0, dtype=np.int64)
_DEMOTION_BATCH = 64  # pages the background demoter moves per pass of the lock
# Bytes the lower-tier writer encodes and puts between looks for a quiet moment: a request that
# arrives mid-chunk shares the cores with it for at most ~1-2 ms (8 pages of 360 KiB, 2.9 MiB,
# put the store-below p99 at 4x of host only; 1 MiB chunks at 1.0-1.5x: PERFORMANCE.md).
_WRITE_CHUNK_BYTES = 1 << 20
_YIELD_S = 0.05  # longest a background step waits for requests in progress to finish
_RETAIN_SHARE = 4  # at most 1/4 of host RAM slots wait for the writer; past that, pages are copied


_F = TypeVar("_F", bound=Any)


def _request_path(method: _F) -> _F:
    """Mark a call as a request in progress: background steps wait (briefly) until none is."""
    @functools.wraps(method)
    def wrapper(self: TieredCache, *args: Any, **kwargs: Any) -> Any:
        with self._foreground:
            return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


class TieredCache(ForkOps, SwapOps, CompactionOps):
    """KV cache over a device page pool, host RAM and optional lower tiers.

    Tensor API: `put`, `get`, `lookup`. Paged API: `match` -> (`prefetch`) -> `load` ->
    `allocate` -> engine writes K/V (`write`, or into `writable_slots` then `mark_written`) ->
    `commit` -> `release`; `fork` makes copy-on-write copies of a handle (forking.py), `swap_out` /
    `swap_in` preempt one (swapping.py), `drop_tokens` applies a retention policy (compaction.py,
    retention.py). KV tensors
    use the shapes of DESIGN.md §6; tokens are 1-D integer sequences; `namespace` defaults to the
    config's.
    """

    def __init__(self, spec: KVSpec, config: CacheConfig | None = None,
                 lower: Sequence[BlobTier] | None = None) -> None:
        self.spec = spec
        self.config = config or CacheConfig()
        if self.config.codec.lossy and spec.dtype is DType.FP8_E4M3:
            raise ValueError("the int8 codec needs fp16, bf16 or fp32 KV")
        if self.config.malloc_tuning:
            tune_malloc()
        # Normal tensors even when built under torch.inference_mode(): background threads (not in
        # inference mode) write into the pool and the host slab too.
        with torch.inference_mode(False):
            self.pool = PagePool.with_capacity(spec, self.config.pool_capacity, self.config.device)
            self.host = HostTier(spec, self.config.host_capacity, on_evict=self._host_evicted,
                                 retain=self._host_retain)
        self.tree = RadixTree(self.config.eviction_policy)
        self.chain = TierChain(list(lower) if lower is not None else build_lower_tiers(self.config, spec.fingerprint))
        self.lower: list[BlobTier] = self.chain.tiers
        self.moves = Movements()
        self._lock = threading.RLock()
        self._demoting = 0  # pages the background demoter took from the tree and has not freed yet
        self._demoting_keys: set[bytes] = set()  # their keys: a lookup waits for them, never misses them
        self._demoted = threading.Condition(self._lock)  # notified when it frees them
        self._keyers: dict[str, PageKeyer] = {}
        self._device = TierStats("device", capacity_bytes=self.pool.num_pages * spec.bytes_per_page)
        self._unused_slots = 0
        self._demoter = BackgroundQueue("demoter", capacity=max(2, self.config.demotion_queue))
        self._writer = BackgroundQueue("lower-writer", capacity=self.config.demotion_queue, nice=BACKGROUND_NICE)
        # Set while no demotion is queued or running: the lower-tier writer waits for it, since
        # room on the device is what the next request needs and a write below is not.
        self._demoter_quiet = threading.Event()
        self._demoter_quiet.set()
        # Pages host RAM dropped that are queued for the tiers below: still served from here
        # until the put is done, so write-behind never opens a window of misses.
        self._in_flight: dict[bytes, torch.Tensor] = {}
        self.promoter = Promoter(spec, self.pool, self.host, self.chain, self._lock, self._in_flight, self.moves,
                                 self.config)
        self._staging = self.promoter.staging  # leased by demotion and swaps too
        self.reuse = self.promoter.reuse  # the reuse policy's estimates (promotion.py, reuse.py)
        self._pages_dropped = 0  # pages whose write below was dropped (write-behind full)
        self._foreground = Foreground()  # requests in progress: background steps wait for a gap
        # get() without out= on a CPU pool: one output tensor faulted in ahead (spare_output.py).
        self._spare = (SpareOutput(self._foreground, self.pool.num_pages * spec.bytes_per_page)
                       if self.config.spare_output and self.pool.kv.device.type == "cpu" else None)
        self._closed = False
        self._live: set[CacheHandle] = set()  # handles not released yet: they hold their own pages
        self._loose = 0  # pages allocated outside any holder while a copy fills them (put, load)
        self._forks = 0
        self._cow_copies = 0
        self._pages_compacted = 0  # pages freed by retention policies
        self._page_tokens = PageTokens()  # token ids of inserted pages, for tree() previews
        self.metrics: Any = None  # a MetricsServer with config.metrics_port
        self._fetch_metrics: Any = None
        if self.config.metrics_port is not None:
            self._serve_metrics()

    def _serve_metrics(self) -> None:
        from tiered_cache.metrics import registry_of
        from tiered_cache.metrics.families import cache_families, tier_families
        from tiered_cache.metrics.http import MetricsServer
        from tiered_cache.metrics.live import FetchMetrics

        def build() -> list[Any]:
            stats = self.stats()
            return [*tier_families(stats.tiers), *cache_families(stats)]

        registry = registry_of(build)
        self._fetch_metrics = FetchMetrics(registry)
        self.chain.observe_fetches(self._fetch_metrics.fetched)
        c = self.config
        routes = {"/tree": lambda: json.dumps(self.prefix_tree()).encode()}  # for `tiered-cache tree --url`
        self.metrics = MetricsServer(registry, c.metrics_host, c.metrics_port or 0, c.metrics_token, routes)

    # --- tensor API ------------------------------------------------------------------------------
    @_request_path
    def put(self, tokens: Any, kv: torch.Tensor, namespace: str | None = None) -> int:
        """Cache the KV of `tokens` (shape (layers, 2, len(tokens), kv_heads, head_dim)).

        Only full pages are cached; when the pool cannot hold them all, the leading pages that fit
        are. Returns how many tokens were newly stored (pages already on the device are skipped).
        Raises KVShapeError, TypeError or ValueError for bad input before anything changes.
        """
        ns = self._ns(namespace)
        toks = as_token_array(tokens)
        self._check_kv(kv, len(toks))
        keys = self._keyer(ns).keys(toks)
        ps = self.spec.page_size
        with self._lock:
            match = self.tree.match_prefix(keys, ns)
            if match.num_pages == len(keys):
                return 0
            self.tree.lock(match.node)  # keep the prefix on the device while room is made
            try:
                pages = self._allocate_fitting(len(keys) - match.num_pages)
            except BaseException:
                self.tree.unlock(match.node)
                raise
            self._loose += len(pages)
        n = len(pages)
        start = match.num_pages
        try:
            if n:  # the pages are ours until adopted: the copy needs no lock
                self.pool.store(self.pool.slots(pages, n * ps), kv[:, :, start * ps:(start + n) * ps])
        except BaseException:
            with self._lock:
                self.pool.free(pages)
                self._loose -= n
                self.tree.unlock(match.node)
            raise
        with self._lock:
            self.tree.unlock(match.node)
            self._loose -= n
            if not n:
                return 0
            self._device.bytes_in += n * self.spec.bytes_per_page
            _, _, dup = self._adopt(ns, keys[:start + n], match.values, pages, toks)
            self._after_insert(ns, keys[:start + n], n - dup)
        return (n - dup) * ps

    @_request_path
    def lookup(self, tokens: Any, namespace: str | None = None) -> int:
        """How many leading tokens `match` would give: cached in any tier and, under the FASTER
        reuse policy, worth loading (whole pages; nothing is moved or counted)."""
        ns = self._ns(namespace)
        keys = self._keyer(ns).keys(as_token_array(tokens))
        with self._lock:
            self._await_keys(keys)
            on_device = self.tree.match_prefix(keys, ns).num_pages
            in_host = [k in self.host.index or k in self._in_flight for k in keys[on_device:]]
        plan = self.promoter.plan(keys[on_device:], in_host)
        return (on_device + self.promoter.reuse_cut(plan)) * self.spec.page_size

    @_request_path
    def get(self, tokens: Any, namespace: str | None = None,
            out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """The longest cached prefix of `tokens` that fits on the device: (n tokens, KV of shape
        (layers, 2, n, heads, dim)). Pages found below the device are promoted first.

        `out`, a (layers, 2, len(tokens), heads, dim) tensor of the spec's dtype on any device,
        receives the KV (its first n tokens; the view is returned): reusing it saves faulting in
        fresh memory on every call.
        """
        toks = as_token_array(tokens)
        if out is not None:
            check_tensor("out", out, self.spec.kv_shape(len(toks)), self.spec.dtype.torch, self.spec.model_id)
        handle = self.match(toks, namespace)
        try:
            pages = self.load(handle)
            n = len(pages) * self.spec.page_size
            if out is not None:
                return n, self.pool.read_tokens(pages, n, out=out[:, :, :n])
            if self._spare is None or not n:
                return n, self.pool.read_tokens(pages, n)
            shape, dtype = self.spec.kv_shape(n), self.pool.kv.dtype
            result = self.pool.read_tokens(pages, n, out=self._spare.take(shape, dtype))
            self._spare.refill(shape, dtype)  # the next get of this size finds memory faulted in
            return n, result
        finally:
            self.release(handle)

    # --- paged API -------------------------------------------------------------------------------
    @_request_path
    def match(self, tokens: Any, namespace: str | None = None) -> CacheHandle:
        """Find the cached prefix and lock its device pages. Pages found only below the device
        (host RAM, lower tiers: each asked once) are counted in `available_pages` and planned for
        `prefetch` / `load`: under the FASTER reuse policy only the leading ones that arrive sooner
        than the engine would compute them (the rest are counted in `stats().reuse`)."""
        ns = self._ns(namespace)
        toks = as_token_array(tokens)
        return self._match_keys(ns, self._keyer(ns).keys(toks), toks, reuse_policy=True)

    def _match_keys(self, ns: str, keys: list[bytes], toks: Any, reuse_policy: bool = False) -> CacheHandle:
        """`match` on computed keys. `reuse_policy`: cut the plan where loading stops paying; off
        for callers that need the whole prefix back (`swap_in`: the request's own pages follow it)."""
        with self._lock:
            self._check_open()
            self._await_keys(keys)
            result = self.tree.match_prefix(keys, ns)
            self._count_device(result.num_pages, len(keys))
            self.tree.lock(result.node)
            in_host = [k in self.host.index or k in self._in_flight for k in keys[result.num_pages:]]
        try:
            plan = self.promoter.plan(keys[result.num_pages:], in_host)
        except BaseException:
            with self._lock:
                self.tree.unlock(result.node)
            raise
        if reuse_policy:
            plan = self.promoter.worth_loading(keys[result.num_pages:], plan)
        handle = CacheHandle(self, ns, self.spec.page_size, keys, result.node, result.values,
                             result.num_pages + len(plan), plan, tokens=toks)
        handle.sources["device"] = result.num_pages
        with self._lock:
            self._live.add(handle)
        return handle

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Tell the reuse policy that the engine prefilled `num_tokens` tokens in `seconds` (the
        forward of the uncached part alone, not the load; on CUDA after a synchronize). The
        FASTER policy plans with this rate unless `CacheConfig.prefill_tokens_per_s` fixes one.
        Raises ValueError for a negative count or time."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        if not seconds >= 0:
            raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
        self.reuse.observe_prefill(int(num_tokens), float(seconds))

    @_request_path
    def prefetch(self, handle: CacheHandle) -> bool:
        """Start bringing the handle's pages below the device up into staging memory in the
        background; `load` then waits only for what has not arrived. Returns False (and `load`
        fetches inline) when there is nothing below or `max_prefetches` are already in flight.
        `release` cancels a prefetch that is still running."""
        with self._lock:
            self._check_live(handle)
            if handle.prefetch is not None:
                return True
            start = handle.num_device_pages
            wanted, plan = handle.keys[start:handle.available_pages], handle.plan[:handle.available_pages - start]
            if not wanted:
                return False
            if all(where == HOST for where in plan) or self.promoter.in_arenas(plan):
                return False  # `load` copies these straight into the pool: nothing to stage
            handle.prefetch = self.promoter.prefetch(wanted, plan)
        return handle.prefetch is not None

    @_request_path
    def load(self, handle: CacheHandle) -> np.ndarray:
        """Bring the handle's pages found below the device into device pages; returns all the
        prefix's device pages, in order. Pages that turn out missing or corrupt end the prefix,
        and so does a full pool: the prefix then ends where the room did (the engine computes
        the rest). Never raises PoolExhaustedError."""
        with self._lock:
            self._check_live(handle)
            start = handle.num_device_pages
            wanted, plan = handle.keys[start:handle.available_pages], handle.plan[:handle.available_pages - start]
            if wanted and handle.own_pages:
                raise ValueError("load() after allocate(): the pages allocated for the suffix would no longer "
                                 "follow the prefix; call load() before allocate()")
            pending, handle.prefetch = handle.prefetch, None
        if not wanted:
            return handle.device_pages
        if pending is None and all(where == HOST for where in plan):
            loaded = self._load_from_host(handle, start, wanted)
            if loaded is not None:
                return loaded
        fetched = None
        if pending is not None:
            waited = time.perf_counter()
            try:
                fetched = pending.future.result()
            except Exception:  # a failed prefetch is retried inline, never surfaced as an error
                fetched = None
            if self._fetch_metrics is not None:
                self._fetch_metrics.prefetch_wait.observe(time.perf_counter() - waited)
        if fetched is None and HOST not in plan and (self.promoter.fills_pool or self.promoter.from_arenas(plan)):
            # Every page below host RAM, and a CPU pool (or, on CUDA, pages in same-host store
            # arenas): device pages first, then each page lands straight in its own (one copy or
            # one DMA, no staging); only as many are fetched as fit. (With pages in host RAM,
            # allocating first could evict them before they are copied: the staged path copies
            # them out first.)
            return self._install(handle, start, len(wanted),
                                 lambda pages: self.promoter.fetch(wanted[:len(pages)], plan[:len(pages)], pages=pages))
        if fetched is None:
            fetched = self.promoter.fetch(wanted, plan)
        staged = fetched

        def from_staging(pages: np.ndarray) -> Fetched:
            self.promoter.staged_to_pool(staged, pages)
            return staged

        try:
            return self._install(handle, start, staged.n, from_staging)
        finally:
            self.promoter.give_back(staged)

    @_request_path
    def allocate(self, handle: CacheHandle, num_tokens: int) -> np.ndarray:
        """Room for `num_tokens` more tokens after those the handle already has pages for: fills the
        free slots of its last page first, then allocates new device pages (evicting if needed).
        Returns only the new pages. Raises PoolExhaustedError when eviction cannot make room."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        with self._lock:
            self._check_live(handle)
            needed = self.spec.pages_for_tokens(handle.own_tokens + num_tokens) - len(handle.own_pages)
            pages = self._allocate(max(0, needed))
            self._unused_slots -= self._handle_unused(handle)
            handle.own_pages.extend(pages.tolist())
            handle.own_tokens += int(num_tokens)
            self._unused_slots += self._handle_unused(handle)
            self._maybe_demote()
        return pages

    @_request_path
    def write(self, handle: CacheHandle, kv: torch.Tensor) -> None:
        """Write the KV of the handle's next `kv.shape[2]` tokens (tensor-API shape) into its own
        pages, after the tokens already written, and count them as written."""
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5:
            raise ValueError(f"write() needs a (layers, 2, tokens, kv_heads, head_dim) tensor, got "
                             f"{getattr(kv, 'shape', type(kv).__name__)}")
        n = int(kv.shape[2])
        self._check_kv(kv, n)
        with self._lock:
            self._check_writable(handle, n)
            self._make_private(handle, handle.own_written, handle.own_written + n)  # copy-on-write
            slots = self.pool.slots(np.array(handle.own_pages, dtype=np.int64), handle.own_written + n)
        self.pool.store(slots[handle.own_written:], kv)  # the handle's own private pages: no lock needed
        handle.own_written += n

    @_request_path
    def mark_written(self, handle: CacheHandle, num_tokens: int) -> None:
        """Record that the engine wrote the KV of the handle's next `num_tokens` tokens itself
        (into `pool.kv`, at the slots `writable_slots` gave). Only written tokens are ever
        committed. Raises ValueError past the tokens allocated, or over a page a fork shares."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        with self._lock:
            self._check_writable(handle, int(num_tokens))
            self._require_private(handle, handle.own_written, handle.own_written + int(num_tokens))
            handle.own_written += int(num_tokens)

    @_request_path
    def commit(self, handle: CacheHandle, tokens: Any, num_written: int | None = None) -> int:
        """Insert the full pages of `tokens` whose KV was written: the matched prefix and the
        suffix the engine wrote into the handle's own pages (`write` / `mark_written`).

        `num_written` (default: everything the handle knows was written) is how many leading
        tokens of `tokens` to commit; a partly written page is never inserted. Committing tokens
        that were not written is a ValueError, and so are tokens that do not start with the
        handle's prefix. Returns the number of tokens newly cached.
        """
        ns_tokens = as_token_array(tokens)
        with self._lock:
            self._check_live(handle)
            if handle.compacted:
                raise ValueError("commit() of a sequence a retention policy compacted: its KV is no longer the KV "
                                 "of its tokens, so it is never cached as a prefix; release it")
            written = handle.written_tokens
            if num_written is None:
                if len(ns_tokens) > written:
                    raise ValueError(f"commit() got {len(ns_tokens)} tokens but only {written} were written "
                                     f"(write()/mark_written()); pass num_written={written} to commit the "
                                     f"written part")
                num_written = len(ns_tokens)
            if isinstance(num_written, bool) or not isinstance(num_written, (int, np.integer)) or num_written < 0:
                raise ValueError(f"num_written must be a non-negative integer, got {num_written!r}")
            if num_written > written:
                raise ValueError(f"commit(num_written={num_written}) but only {written} tokens of this handle "
                                 f"were written ({handle.prefix_tokens} matched + {handle.own_written} written)")
            if num_written > len(ns_tokens):
                raise ValueError(f"commit(num_written={num_written}) but only {len(ns_tokens)} tokens were given")
            keys = self._keyer(handle.namespace).keys(ns_tokens[:num_written])
            start = handle.num_device_pages
            if keys[:start] != handle.keys[:min(start, len(keys))]:
                raise ValueError("commit() tokens do not start with the prefix this handle matched")
            n_new = min(len(keys) - start, len(handle.own_pages))
            if n_new <= 0:
                return 0
            new_pages = np.array(handle.own_pages[:n_new], dtype=np.int64)
            self._unused_slots -= self._handle_unused(handle)
            del handle.own_pages[:n_new]  # from here on the tree owns them (or they are freed as duplicates)
            moved = n_new * self.spec.page_size
            handle.own_tokens -= moved
            handle.own_written -= moved
            self._unused_slots += self._handle_unused(handle)
            node, all_pages, dup = self._adopt(handle.namespace, keys[:start + n_new], handle.device_pages,
                                               new_pages, ns_tokens)
            self._move_lock(handle, node)
            handle.keys, handle.device_pages = keys, all_pages
            handle.available_pages = len(all_pages)
            handle.plan = []
            self._after_insert(handle.namespace, keys[:start + n_new], n_new - dup)
            return (n_new - dup) * self.spec.page_size

    @_request_path
    def release(self, handle: CacheHandle) -> None:
        """Unlock the prefix, cancel a prefetch still running, and free the pages the handle still
        owns (e.g. a partial last page). Raises ValueError for a handle of another cache or one
        released already."""
        with self._lock:
            self._check_live(handle, allow_swapped=True)
            if handle.swapped is not None:
                self._release_swapped(handle)  # its prefix was unlocked and its pages freed then
            else:
                self.tree.unlock(handle.node)
                self._unused_slots -= self._handle_unused(handle)
            if handle.own_pages:
                self.pool.free(np.array(handle.own_pages, dtype=np.int64))
            handle.own_pages.clear()
            handle.own_tokens = handle.own_written = 0
            handle.released = True
            self._live.discard(handle)
            pending, handle.prefetch = handle.prefetch, None
        if pending is not None:
            pending.cancel.set()
            self.promoter.give_back_when_done(pending.future)

    def evict(self, num_pages: int | None = None) -> int:
        """Move up to `num_pages` unlocked device pages (all when None) down to host RAM, least
        recently used first, freeing them in the pool. Returns how many pages were moved."""
        with self._lock:
            evicted = self.tree.evict(self.tree.size_info().evictable if num_pages is None else num_pages)
            self._demote_now(evicted)
            return sum(len(node.keys) for node in evicted)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the background demotions and lower-tier writes queued so far are done
        (tests, benches, a clean shutdown). False if `timeout` passed first."""
        return self._demoter.flush(timeout) and self._writer.flush(timeout)

    def set_remote_addresses(self, addresses: Sequence[str]) -> bool:
        """Point the remote tier at `addresses` (a cluster's shard directory changed). Keys move to
        their new owners by rendezvous hashing: a key whose owner left reads as a miss. What this
        cache knew the old owners held is forgotten for the moved keys, and the pages it holds in
        host RAM whose owner changed are put to their new owners in the background, so a shard
        that joins gets the hot prefixes every instance holds (they would otherwise never be
        written again). Returns whether anything changed; raises ValueError without a remote tier."""
        from tiered_cache.tiers.remote import owner_address

        index = next((i for i, t in enumerate(self.chain.tiers) if hasattr(t, "set_addresses")), None)
        if index is None:
            raise ValueError("this cache has no remote tier (lower_tiers has no 'remote')")
        tier: Any = self.chain.tiers[index]
        old = tier.addresses
        if not tier.set_addresses(addresses):
            return False
        new = tier.addresses

        def moved(key: bytes) -> bool:
            return owner_address(key, old) != owner_address(key, new)

        self.chain.forget(index, moved)
        if new and not self._writer.submit(self._republish, index, moved):
            self._pages_dropped += 1  # the write-behind queue is full: counted, not waited for
        return True

    def _republish(self, index: int, moved: Callable[[bytes], bool]) -> None:
        """Background: put the pages host RAM holds whose owner moved into lower tier `index`, a
        chunk at a time after a quiet moment, as every write below does."""
        with self._lock:
            held = list(self.host.index)
        self._write_host_below([k for k in held if moved(k)], [index])  # hashing outside the lock

    # --- statistics ------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            usage = self.pool.usage()
            size = self.tree.size_info()
            device = replace(self._device, pages=size.total, used_bytes=size.total * self.spec.bytes_per_page)
            tiers = [device, self.moves.apply(self.host.stats())]
            pool = PoolFigures(usage.total_pages, usage.used_pages, usage.free_pages, usage.page_bytes,
                               self._unused_slots, int((self.pool.allocator.refs > 1).sum()), self._forks,
                               self._cow_copies, sum(len(h.swapped.slots) for h in self._live if h.swapped),
                               self._pages_compacted)
            nodes = self.tree.num_nodes
        for tier in self.chain.stats():
            tiers.append(replace(tier, corrupt=tier.corrupt + self.moves.refused[tier.name]))
        queues = [self._demoter.figures(), self._writer.figures()]
        return CacheStats(tiers, pool, self.spec.page_size, nodes, size.evictable, size.protected, queues,
                          self.promoter.declined, self.chain.skipped_puts,
                          self._pages_dropped, self.reuse.figures())

    def prefix_tree(self, max_nodes: int = 500, decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
        """The radix tree of prefixes as plain data (tree_view.py), for `tiered-cache tree`; with
        `decode` (token ids -> text), each node's first and last page as text too."""
        def where(keys: list[bytes]) -> list[str]:
            tiers = ["host"] if self.host.contains_prefix(keys) == len(keys) else []
            return tiers + [t.name for i, t in enumerate(self.chain.tiers)
                            if all(self.chain.known_in(k, i) for k in keys)]

        with self._lock:
            view = snapshot(self.tree, self.spec.page_size, self._page_tokens, where, max_nodes)
        stats = self.stats()
        view["tiers"] = {t.name: t.pages for t in stats.tiers}
        view["reuse"] = stats.reuse.to_dict() if stats.reuse is not None else None
        return decode_previews(view, decode) if decode is not None else view

    def close(self) -> None:
        """Finish queued background work, then close the lower tiers' connections."""
        if self._closed:
            return
        self._demoter.close()  # runs what is queued first (it may queue writes below)
        self._writer.close()
        self._closed = True
        self.promoter.close()
        if self._spare is not None:
            self._spare.close()
        if self.metrics is not None:
            self.metrics.stop()
        self.chain.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_integrity(self) -> None:
        """Tree and pool invariants, and page holder counts: every page the tree or a live handle
        holds has exactly that many holders in the pool; pages allocated with no holder are only
        those a copy is filling now (background demotion, a put or load under way)."""
        with self._lock:
            self.tree.check_integrity()
            self.pool.check_integrity()
            held = self.tree.size_info().total
            if held > self.pool.usage().used_pages:
                raise AssertionError(f"the tree holds {held} pages but only {self.pool.usage().used_pages} "
                                     "are in use")
            counts, refs = self._holder_counts(), self.pool.allocator.refs
            wrong = np.flatnonzero((counts > 0) & (counts != refs))
            if wrong.size:
                raise IntegrityError(f"pages {wrong.tolist()[:16]} have {refs[wrong].tolist()[:16]} holders in the "
                                     f"pool but {counts[wrong].tolist()[:16]} known holders")
            orphans = int(((counts == 0) & (refs > 0)).sum())
            if orphans > self._demoting + self._loose:
                raise IntegrityError(f"{orphans} pages are allocated with no holder ({self._demoting} being "
                                     f"demoted, {self._loose} being filled): leaked")

    # --- ownership (call with the lock held) ------------------------------------------------------
    def _adopt(self, ns: str, keys: list[bytes], prefix_pages: np.ndarray, new_pages: np.ndarray,
               tokens: np.ndarray) -> tuple[RadixNode, np.ndarray, int]:
        """Insert `keys` held in `prefix_pages` + `new_pages` and hand the new pages to the tree;
        the new pages' token ids (from `tokens`, the whole sequence) are remembered for `prefix_tree`.

        Another request may have cached some of the same pages meanwhile (two handles that
        matched the same prefix): the tree keeps its copies and the duplicates are freed here.
        Returns the node ending at the last key, the tree's pages for all keys, and the number
        of duplicates (the leading new pages the tree already had).
        """
        inserted = self.tree.insert(keys, np.concatenate([prefix_pages, new_pages]), ns, Tier.DEVICE)
        self._page_tokens.record(keys, tokens, self.spec.page_size, first=len(prefix_pages))
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

    def _install(self, handle: CacheHandle, start: int, num_pages: int,
                 fill: Callable[[np.ndarray], Fetched]) -> np.ndarray:
        """Allocate up to `num_pages` device pages (as many as fit), have `fill` bring the
        prefix's next pages into them, and put the leading ones that arrived into the tree; the
        rest are freed. The pages are ours until adopted: `fill` runs without the lock."""
        with self._lock:
            self._check_live(handle)
            pages = self._allocate_fitting(num_pages)
            self._loose += len(pages)
        try:
            filled = fill(pages) if len(pages) else None
        except BaseException:
            with self._lock:
                self.pool.free(pages)
                self._loose -= len(pages)
            raise
        n = min(filled.n, len(pages)) if filled is not None else 0
        with self._lock:
            self._loose -= len(pages)
            if n < len(pages):
                self.pool.free(pages[n:])  # from the first page that did not arrive: never adopted
            return self._adopt_loaded(handle, start, pages[:n], filled.tiers[:n] if filled is not None else [])

    def _load_from_host(self, handle: CacheHandle, start: int, wanted: list[bytes]) -> np.ndarray | None:
        """All of `wanted` in host RAM: copy its slots straight into new device pages, one copy
        instead of two through a staging buffer. The lock is held from finding the slots to the
        end of the copy, so they cannot be evicted or reused meanwhile. When the device is short
        of free pages, cold device pages are demoted first (into host RAM, or below where it is
        full), with the pages being loaded held out of host RAM eviction's reach meanwhile. None
        (nothing done) when host RAM lacks a page or the device cannot make room: `load` then
        takes the staged path."""
        n = len(wanted)
        with self._lock:
            self._check_live(handle)
            if self.host.contains_prefix(wanted) < n:
                return None
            shortfall = n - self.pool.num_free
            if shortfall > 0:
                if self.tree.size_info().evictable < shortfall:
                    return None
                held = self.host.hold(wanted)  # out of eviction's reach while cold pages come down
                try:
                    self._demote_now(self.tree.evict(shortfall))
                finally:
                    self.host.unhold(held)
                if self.pool.num_free < n:
                    return None
            pages = self.pool.allocate(n)
            slots = self.host.leading_slots(wanted)
            self.promoter.host_to_pool(slots, pages)
            return self._adopt_loaded(handle, start, pages, ["host"] * len(pages))

    def _adopt_loaded(self, handle: CacheHandle, start: int, pages: np.ndarray, tiers: list[str]) -> np.ndarray:
        """Pages loaded for `handle` after its first `start`: into the tree, counted (lock held)."""
        n = len(pages)
        for name in tiers:
            handle.sources[name] += 1
        self.moves.promotions["host"] += tiers.count("host")
        if n:
            self._device.bytes_in += n * self.spec.bytes_per_page
            node, all_pages, _ = self._adopt(handle.namespace, handle.keys[:start + n], handle.device_pages, pages,
                                             handle.tokens)
            self._move_lock(handle, node)
            handle.device_pages = all_pages
        handle.available_pages = start + n
        handle.plan = []
        self._maybe_demote()
        return handle.device_pages

    # --- movement between tiers -------------------------------------------------------------------
    def _allocate(self, n: int) -> np.ndarray:
        """`n` device pages, evicting (device -> host, inline) when the pool is short."""
        self._await_demoter(n)
        shortfall = n - self.pool.num_free
        if shortfall > 0:
            self._demote_now(self.tree.evict(shortfall))
        if not self.pool.can_allocate(n):
            raise PoolExhaustedError(n, self.pool.num_free, self.pool.num_pages)
        return self.pool.allocate(n)

    def _allocate_fitting(self, n: int) -> np.ndarray:
        """Up to `n` device pages: as many as free and evictable pages allow."""
        self._await_demoter(n)
        room = self.pool.num_free + self.tree.size_info().evictable
        return self._allocate(min(n, room)) if n else _NO_PAGES

    def _await_keys(self, keys: list[bytes]) -> None:
        """Wait (briefly, lock released meanwhile) while the background demoter is moving any of
        `keys` from the device to host RAM: they are in neither place until it is done."""
        if self._demoting_keys and not self._demoting_keys.isdisjoint(keys):
            self._demoted.wait_for(lambda: self._demoting_keys.isdisjoint(keys), timeout=1.0)

    def _await_demoter(self, n: int) -> None:
        """When `n` pages are not free yet but the background demoter holds pages it is about to
        free, wait for them (briefly; lock held, released while waiting): finishing a copy
        already under way costs the request less than starting its own eviction beside it."""
        if self._demoting and n > self.pool.num_free:
            self._demoted.wait_for(lambda: not self._demoting or n <= self.pool.num_free, timeout=1.0)

    def _demote_now(self, evicted: list[EvictedNode]) -> None:
        """Evicted nodes' pages: copy those host RAM lacks into it, then free them (lock held)."""
        if not evicted:
            return
        keys = [k for node in evicted for k in node.keys]
        pages = np.concatenate([node.values for node in evicted])
        try:
            self._copy_to_host(keys, pages)
        finally:  # out of the tree either way: a failed copy loses those pages, never leaks them
            self.pool.free(pages)
            self._device.evictions += len(keys)

    def _copy_to_host(self, keys: list[bytes], pages: np.ndarray) -> None:
        """Copy the pages host RAM lacks straight into host RAM slots (lock held)."""
        missing = [i for i, k in enumerate(keys) if k not in self.host.index]
        if not missing:
            return
        chosen = [keys[i] for i in missing]
        new, slots, overflow = self.host.reserve(chosen)
        spill, copied = None, False
        try:
            spill = self._pages_to_slots(pages[missing], new, slots, overflow)
            copied = True
        finally:
            self._fill_or_free(chosen, new, slots, copied)
        if spill is not None:
            self._host_evicted([chosen[i] for i in overflow], spill)
        self._device.bytes_out += len(missing) * self.spec.bytes_per_page

    def _pages_to_slots(self, pages: np.ndarray, new: list[int], slots: np.ndarray,
                        overflow: list[int], background: bool = False) -> torch.Tensor | None:
        """Copy device `pages[new]` into reserved host `slots` (one DMA per run of slots on CUDA, no
        staging), and return a host copy of `pages[overflow]` (no room in host RAM) for below.
        `background`: a request's copy waits behind one chunk of this one, not all of it."""
        if new:
            self.host.before_write()
            self.promoter.copier.from_pool(pages[new], self.host.slab, slots, background=background)
        if not overflow:
            return None
        with torch.inference_mode(False):
            return self.pool.gather(pages[overflow], out=torch.empty(self.spec.staging_shape(len(overflow)),
                                                                     dtype=self.pool.kv.dtype))

    def _fill_or_free(self, keys: list[bytes], new: list[int], slots: np.ndarray, copied: bool) -> None:
        """Reserved host slots after a copy into them (lock held): indexed under their keys when the
        copy finished, else freed. Host RAM has no checksum: a slot the copy never wrote must never
        be read as KV."""
        if copied:
            self.host.fill([keys[i] for i in new], slots)
            self.moves.demotions["host"] += len(new)
        else:
            self.host.slots.free(slots)

    def _maybe_demote(self) -> None:
        """Above the high watermark, have the background demoter bring the pool down to the low one."""
        used = self.pool.usage().used_pages
        if self._demoter_quiet.is_set() and used > self.config.high_watermark * self.pool.num_pages:
            self._demoter_quiet.clear()
            if not self._demoter.submit(self._demote_to_low_watermark):
                self._demoter_quiet.set()

    def _demote_to_low_watermark(self) -> None:
        """Background: move cold pages device -> host RAM in batches until the low watermark.
        A batch leaves the tree under the lock; its pages are then copied out without the lock
        (no one else can reach them: not in the tree, not free) and handed to host RAM and freed
        under it again, so requests wait for the demoter only while it touches metadata."""
        try:
            while True:
                self._foreground.wait_idle(_YIELD_S)
                with self._lock:
                    excess = self.pool.usage().used_pages - int(self.config.low_watermark * self.pool.num_pages)
                    if excess <= 0 or self._closed:
                        return
                    evicted = self.tree.evict(min(excess, _DEMOTION_BATCH))
                    if not evicted:
                        return
                    keys = [k for node in evicted for k in node.keys]
                    pages = np.concatenate([node.values for node in evicted])
                    missing = [i for i, k in enumerate(keys) if k not in self.host.index]
                    self._demoting += len(pages)
                    self._demoting_keys.update(keys)
                    chosen = [keys[i] for i in missing]
                    new, slots, overflow = self.host.reserve(chosen)  # host slots now ours too
                spill, copied = None, False
                try:
                    # The copies need no lock: no one else can reach these pages (out of the tree,
                    # not free) or these slots (allocated, not indexed).
                    spill = self._pages_to_slots(pages[missing], new, slots, overflow, background=True)
                    copied = True
                finally:
                    with self._lock:
                        self._fill_or_free(chosen, new, slots, copied)
                        if overflow and spill is not None:
                            self._host_evicted([chosen[i] for i in overflow], spill)
                        self._device.bytes_out += len(missing) * self.spec.bytes_per_page
                        self.pool.free(pages)
                        self._device.evictions += len(keys)
                        self._demoting -= len(pages)
                        self._demoting_keys.difference_update(keys)
                        self._demoted.notify_all()
        finally:
            self._demoter_quiet.set()

    def _host_retain(self, keys: list[bytes], slots: np.ndarray) -> np.ndarray:
        """Host RAM is dropping these pages (lock held): keep the slots of those the first lower
        tier lacks until the writer has put them below, so nothing is copied on the request path.
        Until then they are served from their slots. At most 1/_RETAIN_SHARE of host RAM waits
        like this; past that the pages are copied out and queued (`_host_evicted`), and when the
        job queue is full the writes are dropped and counted (never waited for). Returns the
        slots kept."""
        if not self.chain.tiers:
            return _NO_PAGES
        todo = [i for i, k in enumerate(keys) if not self.chain.known_in(k, 0)]
        budget = max(0, self.host.num_slots // _RETAIN_SHARE - self.host.num_retained)
        if len(todo) > budget:
            rest = todo[budget:]
            self._host_evicted([keys[i] for i in rest], self.host.slab[torch.from_numpy(slots[rest])])
            todo = todo[:budget]
        if not todo:
            return _NO_PAGES
        kept = slots[todo]
        views = [self.host.slab[int(slot)] for slot in kept]
        chosen = [keys[i] for i in todo]
        if not self._writer.submit(self._write_below, chosen, views, kept):
            self._pages_dropped += len(todo)
            return _NO_PAGES
        for key, view in zip(chosen, views, strict=True):
            self._in_flight[key] = view
        return kept

    def _host_evicted(self, keys: list[bytes], pages: torch.Tensor) -> None:
        """Pages that did not fit in host RAM at all (a copy): queue them for the tiers below, unless
        the first lower tier is known to hold them already."""
        if not self.chain.tiers:
            return
        todo = [i for i, k in enumerate(keys) if not self.chain.known_in(k, 0)]
        if not todo:
            return
        chosen = pages if len(todo) == len(keys) else pages[torch.tensor(todo)]
        chosen_keys = [keys[i] for i in todo]
        if self._writer.submit(self._write_below, chosen_keys, chosen):
            for key, page in zip(chosen_keys, chosen, strict=True):
                self._in_flight[key] = page
        else:
            self._pages_dropped += len(chosen_keys)

    def _after_insert(self, ns: str, keys: list[bytes], num_new: int) -> None:
        """New pages entered the tree. Write-through queues a copy to host RAM and every lower
        tier; the request path itself copies nothing."""
        if self.config.write_policy is WritePolicy.WRITE_THROUGH and num_new > 0:
            self._demoter.submit(self._write_through, ns, keys, num_new)
        self._maybe_demote()

    def _write_through(self, ns: str, keys: list[bytes], num_new: int) -> None:
        """Background: copy the last `num_new` pages of `keys` to host RAM, then queue them below.
        Pages evicted meanwhile were copied to host RAM by the eviction: they are read from there.
        The device -> host copy runs outside the lock (the node is locked so its pages stay, the
        slots are reserved so no one else uses them): a request never waits behind it."""
        first = len(keys) - num_new
        self._foreground.wait_idle(_YIELD_S)
        with self._lock:
            if self._closed:
                return
            match = self.tree.match_prefix(keys, ns)
            on_device = max(first, match.num_pages)
            chosen = [k for k in keys[first:on_device] if k not in self.host.index]
            positions = [first + i for i, k in enumerate(keys[first:on_device]) if k not in self.host.index]
            pages = match.values[positions] if positions else _NO_PAGES
            new, slots, overflow = self.host.reserve(chosen)
            self.tree.lock(match.node)
        spill, copied = None, False
        try:
            spill = self._pages_to_slots(pages, new, slots, overflow, background=True)
            copied = True
        finally:
            with self._lock:
                self.tree.unlock(match.node)
                self._fill_or_free(chosen, new, slots, copied)
                if spill is not None:
                    self._host_evicted([chosen[i] for i in overflow], spill)
                in_host = self.host.contains_prefix(keys[first:])
        if self.chain.tiers and in_host:
            self._writer.submit(self._write_host_below, keys[first:first + in_host], range(len(self.chain.tiers)))

    def _write_host_below(self, keys: list[bytes], tiers: Sequence[int]) -> None:
        """Background: put the pages of `keys` host RAM holds into lower `tiers`, a chunk at a time
        after a quiet moment, each chunk copied out of host RAM under the lock only for that chunk."""
        step = max(1, _WRITE_CHUNK_BYTES // self.spec.bytes_per_page)
        for start in range(0, len(keys), step):
            self._step_aside()
            with self._lock:
                if self._closed:
                    return
                found, pages = self.host.copy_out(keys[start:start + step])
            items = self._encode_politely(found, pages)
            for index in tiers:
                self._step_aside()
                self.chain.put(items, index, demotion=True)

    def _write_below(self, keys: list[bytes], pages: Any, slots: np.ndarray | None = None) -> None:
        """Background: encode pages host RAM dropped and put them into the first lower tier; they
        stop being served from memory then, and `slots` (pages still held in host slots, when
        `retain` kept them) are given back."""
        try:
            self._encode_and_put(keys, pages, 1)
        finally:
            with self._lock:
                for key in keys:
                    self._in_flight.pop(key, None)
                if slots is not None:
                    self.host.release(slots)

    def _encode_and_put(self, keys: list[bytes], pages: Any, num_tiers: int) -> None:
        """Encode pages and put them into the first `num_tiers` lower tiers, a chunk at a time,
        each chunk after a quiet moment (no request in progress and no demotion under way, or
        `_YIELD_S` passed for each), and each page's encode and each put after a request in
        progress ends and no demotion is under way. Why per page: encoding and the client's gRPC
        work hold the GIL, and a request thread (or the demoter) that let the GIL go (every
        torch op does) gets it back only when this thread blocks or after the 5 ms switch
        interval. Checked per chunk, a request that arrived mid-chunk waited for the whole chunk,
        a few times over (p99 1.2-1.8x of host only with a store below; per page 1.03-1.09x,
        docs/PERFORMANCE.md), and a demotion that started mid-chunk stretched past the idle gap,
        so the next request waited for it."""
        step = max(1, _WRITE_CHUNK_BYTES // self.spec.bytes_per_page)
        for start in range(0, len(keys), step):
            items = self._encode_politely(keys[start:start + step], pages[start:start + step])
            for index in range(num_tiers):
                self._step_aside()
                self.chain.put(items, index, demotion=True)

    def _step_aside(self) -> None:
        """Wait until no demotion is under way and no request is in progress (at most `_YIELD_S`
        for each): room on the device is what the next request needs, a write below is not."""
        self._demoter_quiet.wait(_YIELD_S)
        self._foreground.wait_idle(_YIELD_S)

    def _encode_politely(self, keys: list[bytes], pages: Any) -> list[tuple[bytes, bytes]]:
        """(key, blob) of each page, each encoded after `_step_aside`: see `_encode_and_put`
        for why per page."""
        items = []
        for key, page in zip(keys, pages, strict=True):
            self._step_aside()
            items.append((key, self._encode(page, key)))
        return items

    def _encode(self, page: torch.Tensor, key: bytes) -> bytes:
        return encode_page(page, self.spec, key, self.config.codec, self.config.codec_min_saving)

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

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this TieredCache is closed")

    def _check_live(self, handle: CacheHandle, allow_swapped: bool = False) -> None:
        if not isinstance(handle, CacheHandle):
            raise TypeError(f"expected a CacheHandle, got {type(handle).__name__}")
        if handle.owner is not self:
            raise ValueError("this cache handle belongs to another TieredCache")
        if handle.released:
            raise ValueError("this cache handle was already released")
        if handle.swapped is not None and not allow_swapped:
            raise ValueError("this cache handle is swapped out: swap_in() it first")

    def _check_writable(self, handle: CacheHandle, n: int) -> None:
        self._check_live(handle)
        if handle.own_written + n > handle.own_tokens:
            raise ValueError(f"writing {n} more tokens would pass the {handle.own_tokens} allocated "
                             f"({handle.own_written} written so far); allocate() first")
