"""`TieredCache`: the one object an inference engine talks to.

Device pool (indexed by the radix tree) -> host RAM (decoded pages) -> a `TierChain` of blob
tiers (disk, Redis, remote stores). The request path does only what the request needs:

- `match` walks the tree and asks the tiers below once (host RAM, then each lower tier at most
  once) how far the prefix continues (under `reuse: faster`, only as far as loading beats
  recomputing); `prefetch` starts loading those pages in the background and `load` waits
  only for what has not arrived. The load path is `loader.py` (its module doc lists the stages):
  host RAM rows go straight into device pages; a page from below is placed in its device page (CPU
  pool) or in pinned staging, then one DMA (CUDA).
- `commit` inserts only pages whose every token was written (`write` / `mark_written`).
- Demotion is write-behind: above `high_watermark` a background thread moves cold pages device ->
  host until `low_watermark`; host RAM evictions are encoded and put below by another background
  thread through a bounded queue (full: dropped and counted). An allocation that finds the pool
  full still evicts inline, but only copies device -> host there.

The work is done by collaborators (this package's `__init__` lists them), built in one place
(`__init__`, in the order they depend on each other); this class keeps the prefix side of the
public API and the lock, `SequenceOps` (sequence_ops.py) the side of a sequence's own pages.

Thread safety: one lock guards tree, pool and host-RAM metadata (and host-RAM copies, which are
memory); lower-tier I/O, encoding and decoding run outside it. A handle is used by one thread at
a time; several threads may use the cache at once.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tiered_cache.cache.arena_loads import ArenaLoads
from tiered_cache.cache.arguments import as_count, as_namespace
from tiered_cache.cache.canary import Canary
from tiered_cache.cache.compaction import Compaction
from tiered_cache.cache.demoter import Demoter
from tiered_cache.cache.foreground import Foreground, request_path
from tiered_cache.cache.forks import Forks
from tiered_cache.cache.handle import CacheHandle
from tiered_cache.cache.host_loads import HostLoads
from tiered_cache.cache.ledger import PageLedger
from tiered_cache.cache.loader import Loader
from tiered_cache.cache.lower_tiers import build_lower_tiers
from tiered_cache.cache.lower_writer import LowerWriter
from tiered_cache.cache.metrics_endpoint import serve_metrics
from tiered_cache.cache.reuse import ReuseGate
from tiered_cache.cache.sequence_ops import SequenceOps
from tiered_cache.cache.spare_output import SpareOutput
from tiered_cache.cache.stats import CacheStats, Movements, cache_stats
from tiered_cache.cache.swaps import Swaps
from tiered_cache.cache.tensor_reads import TensorReads
from tiered_cache.cache.tier_loads import TierLoads
from tiered_cache.cache.tree_view import tree_of
from tiered_cache.cache.warm_up import warm_up_async
from tiered_cache.config import CacheConfig
from tiered_cache.device.host_copy import HostCopier
from tiered_cache.device.malloc import tune_malloc
from tiered_cache.device.pool import PagePool, check_tensor
from tiered_cache.events.recorder import open_events
from tiered_cache.index.keys import PageKeyer
from tiered_cache.index.radix import RadixTree
from tiered_cache.index.tokens import as_token_array
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.tiers.base import BlobTier
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.host import HostTier


class TieredCache(SequenceOps):
    """KV cache over a device page pool, host RAM and optional lower tiers.

    Tensor API: `put`, `get`, `lookup`. Paged API: `match` -> (`prefetch`) -> `load` ->
    `allocate` -> engine writes K/V (`write`, or into `writable_slots` then `mark_written`) ->
    `commit` -> `release`; `fork` makes copy-on-write copies of a handle (forks.py), `swap_out` /
    `swap_in` preempt one (swaps.py), `drop_tokens` applies a retention policy (compaction.py,
    retention.py). KV tensors use the shapes of DESIGN.md §6; tokens are 1-D integer sequences;
    `namespace` defaults to the config's.
    """

    def __init__(self, spec: KVSpec, config: CacheConfig | None = None,
                 lower: Sequence[BlobTier] | None = None) -> None:
        self.spec = spec
        self.config = config = config or CacheConfig()
        if config.codec.lossy and spec.dtype is DType.FP8_E4M3:
            raise ValueError("the int8 codec needs fp16, bf16 or fp32 KV")
        if config.malloc_tuning:
            tune_malloc()
        # Shared by every part: the lock (tree, pool and host RAM metadata), the requests in
        # progress (background steps wait for a gap), the page movement counters.
        self._lock = threading.RLock()
        self._foreground = Foreground()
        self.moves = Movements()
        demotions_idle = threading.Event()  # set while no demotion is queued or running
        demotions_idle.set()
        # Where pages live: the blob tiers below, host RAM, the device pool and its radix tree.
        self.chain = TierChain(list(lower) if lower is not None else build_lower_tiers(config, spec.fingerprint))
        self.writer = LowerWriter(spec, config, self.chain, self._lock, self._foreground, demotions_idle)
        # Normal tensors even when built under torch.inference_mode(): background threads (not in
        # inference mode) write into the pool and the host slab too.
        with torch.inference_mode(False):
            self.pool = PagePool.with_capacity(spec, config.pool_capacity, config.device)
            self.host = self.writer.host = HostTier(spec, config.host_capacity, on_evict=self.writer.host_evicted,
                                                    retain=self.writer.retain)
        self.tree = RadixTree(config.eviction_policy)
        self.ledger = PageLedger(self, spec, self.pool, self.tree)
        # Loading pages (loader.py's module doc), and the policy that says how far. One copier for
        # every host slab <-> pool copy: its one stream orders loads and demotions of a row.
        copier = HostCopier(self.pool)
        self.tier_loads = TierLoads(spec, self.pool, self.host, self.chain, copier, self._lock, self.writer.in_flight,
                                    config, observe=lambda *sample: self.reuse.observe(*sample))
        self.reuse = ReuseGate(config.reuse, config.prefill_tokens_per_s, self.chain, self.tier_loads.tier_name,
                               spec.bytes_per_page, spec.page_size)
        self.host_loads = HostLoads(self.pool, self.host, copier, self.reuse.observe)
        self.arena_loads = ArenaLoads(self.tier_loads, self.chain, self.reuse.observe)
        # Making room: device -> host RAM, and the engine features built on the ledger.
        self.demoter = Demoter(config, self.ledger, self.host, copier, self.writer, self.moves, self._lock,
                               self._foreground, demotions_idle,
                               settle_copies=lambda: self.host_loads.settle(wait=True))
        self.canary = Canary(config.verify_fraction)  # checks a sample of hits (integrations with the model)
        self.loader = Loader(self.ledger, self.demoter, self.tier_loads, self.host_loads, self.arena_loads, self.reuse,
                             self.writer.in_flight, self.moves, self._lock, self.canary)
        self.tensor_reads = TensorReads(spec, self.pool, self.host, self.chain, self._lock, self.writer.in_flight,
                                        self.moves, self.reuse.observe)
        self.forks = Forks(self.ledger, self.demoter)
        self.swaps = Swaps(self.ledger, self.demoter, self.host, self.tier_loads.staging, self._lock)
        self.compaction = Compaction(self.ledger, self.forks)
        # get() without out= on a CPU pool: one output tensor faulted in ahead (spare_output.py).
        self._spare = (SpareOutput(self._foreground, self.pool.num_pages * spec.bytes_per_page)
                       if config.spare_output and self.pool.kv.device.type == "cpu" else None)
        self._keyer = functools.lru_cache(maxsize=1024)(functools.partial(PageKeyer, spec))  # per namespace
        self._closed = False
        # Connections, threads, staging, memory faulted in, off the request path: join it to wait until ready.
        memory = (self.pool.pretouch, self.host.pretouch)
        self.warming = warm_up_async(self.chain, self.tier_loads, memory, self._foreground)
        self.metrics: Any = serve_metrics(self) if config.metrics_port is not None else None  # a MetricsServer
        self.events = open_events(config, spec.page_size, self.ledger.page_tokens.get)  # KV events, or None
        if self.events is not None:
            self.events.watch(self.tree, self.host, self.chain)

    # --- tensor API ------------------------------------------------------------------------------
    @request_path
    def put(self, tokens: Any, kv: torch.Tensor, namespace: str | None = None) -> int:
        """Cache the KV of `tokens` (shape (layers, 2, len(tokens), kv_heads, head_dim)).

        Only full pages are cached; when the pool cannot hold them all, the leading pages that fit
        are. Returns how many tokens were newly stored (pages already on the device are skipped).
        Raises KVShapeError, TypeError or ValueError for bad input before anything changes.
        """
        ns = self._ns(namespace)
        toks = as_token_array(tokens)
        self._check_kv(kv, len(toks))
        return self.loader.put(ns, self._keyer(ns).keys(toks), toks, kv)

    @request_path
    def lookup(self, tokens: Any, namespace: str | None = None) -> int:
        """How many leading tokens `match` would give: cached in any tier and, under the FASTER
        reuse policy, worth loading (whole pages; nothing is moved or counted)."""
        ns = self._ns(namespace)
        return self.loader.lookup(ns, self._keyer(ns).keys(as_token_array(tokens)))

    @request_path
    def get(self, tokens: Any, namespace: str | None = None,
            out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """The longest cached prefix of `tokens`: (n tokens, KV of shape (layers, 2, n, heads,
        dim)), each page copied once into the result from where it lies: the pool, host RAM (where
        it stays), or, read by its tier, a tier below (tensor_reads.py).

        `out`, a (layers, 2, len(tokens), heads, dim) tensor of the spec's dtype on any device,
        receives the KV (its first n tokens; the view is returned): reusing it saves faulting in
        fresh memory on every call.
        """
        toks = as_token_array(tokens)
        if out is not None:
            check_tensor("out", out, self.spec.kv_shape(len(toks)), self.spec.dtype.torch, self.spec.model_id)
        handle = self.match(toks, namespace)
        try:
            spare, dtype = self._spare, self.pool.kv.dtype
            return self.tensor_reads.get(handle, out, self.load, lambda shape: spare and spare.output(shape, dtype))
        finally:
            self.release(handle)

    # --- paged API -------------------------------------------------------------------------------
    @request_path
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
        if self._closed:
            raise ValueError("this TieredCache is closed")
        return self.loader.match(ns, keys, toks, reuse_policy)

    def page_sources(self, handle: CacheHandle) -> list[str]:
        """The tier each page of `handle`'s prefix came from, in order: "device", "host" or a lower
        tier's name (the canary blames a wrong page on its tier). After `load`, where each page was
        actually read (a page that moved meanwhile is read from where it was found); before, where
        it is planned from."""
        below = handle.loaded_from or [self.tier_loads.tier_name(where) for where in handle.plan]
        return ["device"] * handle.sources["device"] + below

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Tell the reuse policy that the engine prefilled `num_tokens` tokens in `seconds` (the
        forward of the uncached part alone, not the load; on CUDA timed by events around it). The
        FASTER policy plans with this rate unless `CacheConfig.prefill_tokens_per_s` fixes one.
        Raises ValueError for a negative count or time."""
        num_tokens = as_count("num_tokens", num_tokens)
        if not seconds >= 0:
            raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
        self.reuse.estimates.observe_prefill(num_tokens, float(seconds))

    @request_path
    def prefetch(self, handle: CacheHandle) -> bool:
        """Start loading the handle's pages below the device into staging memory in the
        background; `load` then waits only for what has not arrived. Returns False (and `load`
        loads inline) when there is nothing below or `max_prefetches` are already in flight.
        `release` cancels a prefetch that is still running."""
        with self._lock:
            self.ledger.check_live(handle)
            return self.loader.prefetch(handle)

    @request_path
    def load(self, handle: CacheHandle) -> np.ndarray:
        """Bring the handle's pages found below the device into device pages; returns all the
        prefix's device pages, in order. Pages that turn out missing or corrupt end the prefix,
        and so does a full pool: the prefix then ends where the room did (the engine computes
        the rest). Never raises PoolExhaustedError.

        On CUDA the copies out of host RAM may still be running when this returns: the current
        stream waits for them, so kernels queued on it afterwards (the forward) read the loaded
        pages; work on another stream first waits for this one
        (`other.wait_stream(torch.cuda.current_stream())`)."""
        with self._lock:
            self.ledger.check_live(handle)
        return self.loader.load(handle)

    @request_path
    def allocate(self, handle: CacheHandle, num_tokens: int) -> np.ndarray:
        """Room for `num_tokens` more tokens after those the handle already has pages for: fills the
        free slots of its last page first, then allocates new device pages (evicting if needed).
        Returns only the new pages. Raises PoolExhaustedError when eviction cannot make room."""
        num_tokens = as_count("num_tokens", num_tokens)
        with self._lock:
            self.ledger.check_live(handle)
            needed = self.spec.pages_for_tokens(handle.own_tokens + num_tokens) - len(handle.own_pages)
            pages = self.demoter.allocate(max(0, needed))
            with self.ledger.reshaping(handle):
                handle.own_pages.extend(pages.tolist())
                handle.own_tokens += num_tokens
            self.demoter.maybe_demote()
        return pages

    @request_path
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
            self.ledger.check_live(handle)
            num_written = handle.committable(len(ns_tokens), num_written)
            keys = self._keyer(handle.namespace).keys(ns_tokens[:num_written])
            start = handle.num_device_pages
            if keys[:start] != handle.keys[:min(start, len(keys))]:
                raise ValueError("commit() tokens do not start with the prefix this handle matched")
            n_new, dup = self.ledger.commit_own(handle, keys, ns_tokens)
            if n_new:
                self.demoter.after_insert(handle.namespace, keys[:start + n_new], n_new - dup)
            return (n_new - dup) * self.spec.page_size

    @request_path
    def release(self, handle: CacheHandle) -> None:
        """Unlock the prefix, cancel a prefetch still running, and free the pages the handle still
        owns (e.g. a partial last page). Raises ValueError for a handle of another cache or one
        released already."""
        with self._lock:
            self.ledger.check_live(handle, allow_swapped=True)
            if handle.swapped is not None:
                self.swaps.release_swapped(handle)  # its prefix was unlocked and its pages freed then
            else:
                self.tree.unlock(handle.node)
                self.ledger.unused_slots -= self.ledger.unused(handle)
            self.ledger.retire(handle)
            pending, handle.prefetch = handle.prefetch, None
        if pending is not None:
            pending.cancel.set()
            self.tier_loads.give_back_when_done(pending.future)

    # --- housekeeping ----------------------------------------------------------------------------
    def evict(self, num_pages: int | None = None) -> int:
        """Move up to `num_pages` unlocked device pages (all when None) down to host RAM, least
        recently used first, freeing them in the pool. Returns how many pages were moved."""
        with self._lock:
            return self.demoter.evict(num_pages)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the background demotions and lower-tier writes queued so far are done
        (tests, benches, a clean shutdown). False if `timeout` passed first."""
        return self.demoter.flush(timeout) and self.writer.flush(timeout)

    def set_remote_addresses(self, addresses: Sequence[str]) -> bool:
        """Point the remote tier at `addresses` (a cluster's shard directory changed). Keys move to
        their new owners by rendezvous hashing: a key whose owner left reads as a miss. What this
        cache knew the old owners held is forgotten for the moved keys, and the pages it holds in
        host RAM whose owner changed are put to their new owners in the background, so a shard
        that joins gets the hot prefixes every instance holds (they would otherwise never be
        written again). Returns whether anything changed; raises ValueError without a remote tier."""
        return self.writer.set_remote_addresses(addresses)

    def stats(self) -> CacheStats:
        """Figures of every tier, the pool, the tree, the background queues, the reuse policy and
        the canary."""
        return cache_stats(self)

    def prefix_tree(self, max_nodes: int = 500, decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
        """The radix tree of prefixes as plain data (tree_view.py), for `tiered-cache tree`; with
        `decode` (token ids -> text), each node's first and last page as text too."""
        return tree_of(self, max_nodes, decode)

    def check_integrity(self) -> None:
        """Tree and pool invariants, and page holder counts: every page the tree or a live handle
        holds has exactly that many holders in the pool; pages allocated with no holder are only
        those a copy is filling now (background demotion, a put or load under way)."""
        with self._lock:
            self.host_loads.settle(wait=True)  # pages pinned for a copy: released once it ended
            self.ledger.check_integrity()

    def close(self) -> None:
        """Finish queued background work, then close the lower tiers' connections."""
        if self._closed:
            return
        self.canary.close()
        self.demoter.close()  # runs what is queued first (it may queue writes below)
        self.writer.close()
        self._closed = self.demoter.closed = self.writer.closed = True
        with self._lock:
            self.host_loads.settle(wait=True)
        self.tier_loads.close()
        self.arena_loads.close()
        if self._spare is not None:
            self._spare.close()
        if self.metrics is not None:
            self.metrics.stop()
        self.chain.close()
        if self.events is not None:
            self.events.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- argument checks -------------------------------------------------------------------------
    def _ns(self, namespace: str | None) -> str:
        return as_namespace(self.config.namespace if namespace is None else namespace)

    def _check_kv(self, kv: Any, num_tokens: int) -> None:
        """KV in the tensor-API shape (layers, 2, tokens, kv_heads, head_dim) and the spec's dtype."""
        check_tensor("kv", kv, self.spec.kv_shape(num_tokens), self.spec.dtype.torch, self.spec.model_id)
