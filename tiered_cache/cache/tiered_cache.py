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

What the parts share (the lock, the pool, its tree and ledger, host RAM and its writer, the
chain below, the reuse policy, ...) is built once in a `CacheCore` (core.py); each part (this
package's `__init__` lists them) takes the core plus what is its own. This class is the public
API, each call checking its arguments and handing the work to its part.

Thread safety: one lock guards tree, pool and host-RAM metadata (and host-RAM copies, which are
memory); lower-tier I/O, encoding and decoding run outside it. A handle is used by one thread at
a time; several threads may use the cache at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tiered_cache.cache.address_file import follow as follow_address_file
from tiered_cache.cache.arguments import as_count
from tiered_cache.cache.canary import Canary
from tiered_cache.cache.core import CacheCore
from tiered_cache.cache.demoter import Demoter
from tiered_cache.cache.foreground import request_path
from tiered_cache.cache.handle import CacheHandle
from tiered_cache.cache.loader import Loader
from tiered_cache.cache.metrics_endpoint import serve_metrics
from tiered_cache.cache.sequences import Sequences
from tiered_cache.cache.spare_output import SpareOutput
from tiered_cache.cache.stats import CacheStats, cache_stats
from tiered_cache.cache.tensor_reads import TensorReads
from tiered_cache.cache.tree_view import tree_of
from tiered_cache.cache.warm_up import collect_leftovers, warm_up_async
from tiered_cache.config import CacheConfig
from tiered_cache.device.pool import check_tensor
from tiered_cache.index.tokens import as_token_array
from tiered_cache.model.spec import KVSpec
from tiered_cache.tiers.base import BlobTier, Tier


class TieredCache:
    """KV cache over a device page pool, host RAM and optional lower tiers.

    Tensor API: `put`, `get`, `lookup`. Paged API: `match` -> (`prefetch`) -> `load` ->
    `allocate` -> engine writes K/V (`write`, or into `writable_slots` then `mark_written`) ->
    `commit` -> `release`; `fork` makes copy-on-write copies of a handle (forks.py), `swap_out` /
    `swap_in` preempt one (swaps.py), `drop_tokens` applies a retention policy (compaction.py,
    retention.py). KV tensors use the shapes of DESIGN.md §6; tokens are 1-D integer sequences;
    `namespace` defaults to the config's. `pool.kv` is what an engine's attention reads.
    """

    def __init__(self, spec: KVSpec, config: CacheConfig | None = None,
                 lower: Sequence[BlobTier] | None = None) -> None:
        self.core = core = CacheCore(spec, config or CacheConfig(), lower)
        self.spec, self.config, self.pool, self.host, self.tree, self.chain = (
            core.spec, core.config, core.pool, core.host, core.tree, core.chain)
        self.demoter = Demoter(core)  # room on the device
        self.canary = Canary(core.config.verify_fraction)  # checks a sample of hits (integrations with the model)
        self.loader = Loader(core, self.demoter, self.canary)  # match, prefetch, load, put
        self.tensor_reads = TensorReads(core)  # get
        self.sequences = Sequences(core, self.demoter, self.loader.tier_loads.staging)  # a sequence's own pages
        self.spare = SpareOutput.for_pool(core)  # get() without out=: one output faulted in ahead
        if self.spare is not None:
            self.spare.prepare_first(core.pool.kv.dtype)
        # Store servers that move: the list a file keeps, read before the warm-up opens channels.
        self.address_file = follow_address_file(core.config, self.set_remote_addresses)
        # Connections, threads, staging, memory faulted in, off the request path: join it to wait until ready.
        self.warming = warm_up_async(core.chain, self.loader.tier_loads, (core.pool.pretouch, core.host.pretouch),
                                     core.foreground)
        collect_leftovers()  # what building it left behind, not in the middle of its first load
        self.metrics: Any = serve_metrics(self) if core.config.metrics_port is not None else None  # MetricsServer
        self.events = core.events  # the KV event publisher, or None

    # --- tensor API ------------------------------------------------------------------------------
    @request_path
    def put(self, tokens: Any, kv: torch.Tensor, namespace: str | None = None) -> int:
        """Cache the KV of `tokens` (shape (layers, 2, len(tokens), kv_heads, head_dim)).

        Only full pages are cached; when the pool cannot hold them all, the leading pages that fit
        are. Returns how many tokens were newly stored (pages already on the device are skipped).
        Raises KVShapeError, TypeError or ValueError for bad input before anything changes.
        """
        ns, toks = self.core.namespace(namespace), as_token_array(tokens)
        self.core.check_kv(kv, len(toks))
        return self.loader.put(ns, self.core.keys(ns, toks), toks, kv)

    @request_path
    def lookup(self, tokens: Any, namespace: str | None = None) -> int:
        """How many leading tokens `match` would give: cached in any tier and, under the FASTER
        reuse policy, worth loading (whole pages; nothing is moved or counted)."""
        ns = self.core.namespace(namespace)
        return self.loader.lookup(ns, self.core.keys(ns, as_token_array(tokens)))

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
            spare, dtype = self.spare, self.pool.kv.dtype
            return self.tensor_reads.get(handle, out, self.load, lambda shape: spare and spare.output(shape, dtype))
        finally:
            self.release(handle)

    # --- paged API: the prefix -------------------------------------------------------------------
    @request_path
    def match(self, tokens: Any, namespace: str | None = None) -> CacheHandle:
        """Find the cached prefix and lock its device pages. Pages found only below the device
        (host RAM, lower tiers: each asked once) are counted in `available_pages` and planned for
        `prefetch` / `load`: under the FASTER reuse policy only the leading ones that arrive sooner
        than the engine would compute them (the rest are counted in `stats().reuse`)."""
        ns, toks = self.core.namespace(namespace), as_token_array(tokens)
        return self._match_keys(ns, self.core.keys(ns, toks), toks, reuse_policy=True)

    def _match_keys(self, ns: str, keys: list[bytes], toks: Any, reuse_policy: bool = False) -> CacheHandle:
        """`match` on computed keys. `reuse_policy`: cut the plan where loading stops paying; off
        for callers that need the whole prefix back (`swap_in`: the request's own pages follow it)."""
        if self.core.closed:
            raise ValueError("this TieredCache is closed")
        return self.loader.match(ns, keys, toks, reuse_policy)

    def page_sources(self, handle: CacheHandle) -> list[str]:
        """The tier each page of `handle`'s prefix came from, in order: "device", "host" or a lower
        tier's name (the canary blames a wrong page on its tier). After `load`, where each page was
        actually read (a page that moved meanwhile is read from where it was found); before, where
        it is planned from."""
        below = handle.loaded_from or [self.core.tier_name(where) for where in handle.plan]
        return [Tier.DEVICE.value] * handle.sources[Tier.DEVICE] + below

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Tell the reuse policy that the engine prefilled `num_tokens` tokens in `seconds` (the
        forward of the uncached part alone, not the load; on CUDA timed by events around it). The
        FASTER policy plans with this rate unless `CacheConfig.prefill_tokens_per_s` fixes one.
        Raises ValueError for a negative count or time."""
        num_tokens = as_count("num_tokens", num_tokens)
        if not seconds >= 0:
            raise ValueError(f"seconds must be a non-negative number, got {seconds!r}")
        self.core.reuse.estimates.observe_prefill(num_tokens, float(seconds))

    @request_path
    def prefetch(self, handle: CacheHandle) -> bool:
        """Start loading the handle's pages below the device into staging memory in the
        background; `load` then waits only for what has not arrived. Returns False (and `load`
        loads inline) when there is nothing below or `max_prefetches` are already in flight.
        `release` cancels a prefetch that is still running."""
        with self.core.lock:
            self.core.ledger.check_live(handle)
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
        with self.core.lock:
            self.core.ledger.check_live(handle)
        return self.loader.load(handle)

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
        with self.core.lock:
            self.core.ledger.check_live(handle)
            num_written = handle.committable(len(ns_tokens), num_written)
            return self.loader.commit(handle, self.core.keys(handle.namespace, ns_tokens[:num_written]), ns_tokens)

    @request_path
    def release(self, handle: CacheHandle) -> None:
        """Unlock the prefix, cancel a prefetch still running, and free the pages the handle still
        owns (e.g. a partial last page). Raises ValueError for a handle of another cache or one
        released already."""
        with self.core.lock:
            self.core.ledger.check_live(handle, allow_swapped=True)
            self.core.ledger.retire(handle)
            pending, handle.prefetch = handle.prefetch, None
        if pending is not None:
            self.loader.cancel(pending)

    # --- paged API: a sequence's own pages -------------------------------------------------------
    @request_path
    def allocate(self, handle: CacheHandle, num_tokens: int) -> np.ndarray:
        """Room for `num_tokens` more tokens after those the handle already has pages for: fills the
        free slots of its last page first, then allocates new device pages (evicting if needed).
        Returns only the new pages. Raises PoolExhaustedError when eviction cannot make room."""
        return self.demoter.allocate_for(handle, as_count("num_tokens", num_tokens))

    @request_path
    def write(self, handle: CacheHandle, kv: torch.Tensor) -> None:
        """Write the KV of the handle's next `kv.shape[2]` tokens (tensor-API shape) into its own
        pages, after the tokens already written, and count them as written."""
        self.sequences.write(handle, kv)

    @request_path
    def mark_written(self, handle: CacheHandle, num_tokens: int) -> None:
        """Record that the engine wrote the KV of the handle's next `num_tokens` tokens itself
        (into `pool.kv`, at the slots `writable_slots` gave). Only written tokens are ever
        committed. Raises ValueError past the tokens allocated, or over a page a fork shares."""
        self.sequences.mark_written(handle, num_tokens)

    def writable_slots(self, handle: CacheHandle, num_tokens: int) -> np.ndarray:
        """Flat pool slots for the handle's next `num_tokens` tokens (after those written), for an
        engine that writes K/V into `pool.kv` itself and then calls `mark_written`. Pages there
        that a fork shares are copied first, so the writes reach this sequence alone."""
        return self.sequences.writable_slots(handle, num_tokens)

    def fork(self, handle: CacheHandle, n: int) -> list[CacheHandle]:
        """`n` new handles that each continue the sequence `handle` holds: they share its matched
        prefix and its own pages (written or only allocated), and each writes, commits and is
        released on its own. The parent stays live (release it when done). Pages found below the
        device and not loaded yet are not shared: `load()` before forking to share them.
        Raises ValueError for n < 1 or a handle that is not live."""
        return self.sequences.fork(handle, n)

    def swap_out(self, handle: CacheHandle) -> int:
        """Move the handle's own pages to host RAM and free its device pages; returns the pages
        moved. Raises SwapError (nothing changed) when host RAM cannot hold them."""
        return self.sequences.swap_out(handle)

    def swap_in(self, handle: CacheHandle) -> np.ndarray:
        """Bring a swapped-out handle back: its prefix matched (and loaded) again, its own pages
        copied into fresh device pages. Returns the handle's own pages. Raises SwapError when
        the prefix is no longer cached anywhere, PoolExhaustedError when the device has no room;
        either way the handle stays swapped out, unchanged."""
        return self.sequences.swap_in(handle, self._match_keys, self.load, self.release)

    def live_slots(self, handle: CacheHandle) -> np.ndarray:
        """Flat pool slots of the handle's live tokens in order: its matched prefix, then its own
        written tokens that no policy dropped. What attention reads for this sequence."""
        return self.sequences.live_slots(handle)

    def drop_tokens(self, handle: CacheHandle, live_indices: Any) -> int:
        """Drop the tokens at `live_indices` (positions in `live_slots(handle)`) from the sequence:
        attention no longer sees them, pages left with no live token are freed, and the handle
        becomes compacted (never committed). Tokens of the matched prefix are shared and cannot be
        dropped (ValueError), nor can tokens not written yet. Returns the pages freed."""
        return self.sequences.drop_tokens(handle, live_indices)

    # --- housekeeping ----------------------------------------------------------------------------
    def evict(self, num_pages: int | None = None) -> int:
        """Move up to `num_pages` unlocked device pages (all when None) down to host RAM, least
        recently used first, freeing them in the pool. Returns how many pages were moved."""
        with self.core.lock:
            return self.demoter.evict(num_pages)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the background demotions and lower-tier writes queued so far are done
        (tests, benches, a clean shutdown). False if `timeout` passed first."""
        return self.demoter.flush(timeout) and self.core.writer.flush(timeout)

    def set_remote_addresses(self, addresses: Sequence[str]) -> bool:
        """Point the remote tier at `addresses` (a cluster's shard directory changed). Keys move to
        their new owners by rendezvous hashing: a key whose owner left reads as a miss. What this
        cache knew the old owners held is forgotten for the moved keys, and the pages it holds in
        host RAM whose owner changed are put to their new owners in the background, so a shard
        that joins gets the hot prefixes every instance holds (they would otherwise never be
        written again). Returns whether anything changed; raises ValueError without a remote tier."""
        return self.core.writer.set_remote_addresses(addresses)

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
        with self.core.lock:
            self.core.host_loads.settle(wait=True)  # pages pinned for a copy: released once it ended
            self.core.ledger.check_integrity()

    def close(self) -> None:
        """Finish queued background work, then close the lower tiers' connections."""
        if self.core.closed:
            return
        if self.address_file is not None:
            self.address_file.close()
        self.canary.close()
        self.demoter.close()  # runs what is queued first (it may queue writes below)
        self.core.writer.close()
        self.core.closed = True
        self.loader.close()
        if self.spare is not None:
            self.spare.close()
        if self.metrics is not None:
            self.metrics.stop()
        self.core.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
