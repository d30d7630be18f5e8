"""`Loader`: fills new device pages and hands them to the tree: a handle's prefix found below the
device (`load`) or KV the caller gives (`put`).

A load, top-down: `match` plans where each page lies (`TierLoads.plan`) and cuts the plan where
loading stops paying (`ReuseGate`); `load` then takes one of three paths: every page in host RAM
(`HostLoads`: rows straight into device pages), every page in a same-host store arena on CUDA
(`ArenaLoads`: one DMA per run), or the rest (`TierLoads.load`: straight into the device pages
of a CPU pool, else through staging). A `prefetch` runs that load ahead: on a CPU pool into device
pages it allocates, which `load` then only adopts; elsewhere into staging, which `load` copies.

Pages are allocated first (as many as fit: a full pool ends the prefix where the room did), then
filled without the lock (they are nobody else's until adopted: `ledger.loose`), then the leading
ones that arrived go into the tree and the rest are freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiered_cache.cache.arena_loads import ArenaLoads
from tiered_cache.cache.canary import Canary
from tiered_cache.cache.demoter import Demoter
from tiered_cache.cache.handle import HOST, CacheHandle, Prefetch
from tiered_cache.cache.tier_loads import Loaded, TierLoads
from tiered_cache.tiers.base import Tier

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore


class Loader:
    """The fill-then-adopt path of one cache (see the module doc)."""

    def __init__(self, core: CacheCore, demoter: Demoter, canary: Canary) -> None:
        self.canary = canary  # keys found wrong are never reused; quarantined tiers not loaded from
        self.ledger, self.spec, self.pool, self.tree = core.ledger, core.spec, core.pool, core.tree
        self.demoter = demoter
        self.tier_loads = TierLoads(core)
        self.host_loads = core.host_loads
        self.arena_loads = ArenaLoads(core, self.tier_loads)
        self.reuse = core.reuse
        self.host = core.host
        self._in_flight = core.in_flight  # pages on their way below, still served from memory
        self.moves = core.moves
        self._lock = core.lock
        self._live_metrics = core.live_metrics  # live histograms (`LiveMetrics`), when the cache serves metrics

    def lookup(self, ns: str, keys: list[bytes]) -> int:
        """Tokens `match` would give for `keys`; nothing is moved or counted."""
        usable = keys[:self.canary.first_poisoned(keys)]
        with self._lock:
            self.demoter.await_keys(keys)
            on_device = self.tree.match_prefix(usable, ns).num_pages
            in_host = self._in_host(usable[on_device:])
        plan = self.tier_loads.plan(usable[on_device:], in_host, self.canary.quarantined(ns))
        return (on_device + self.reuse.cut(plan)) * self.spec.page_size

    def match(self, ns: str, keys: list[bytes], tokens: Any, reuse_policy: bool) -> CacheHandle:
        """Lock the device prefix of `keys` and plan the rest; see `TieredCache.match`."""
        usable = keys[:self.canary.first_poisoned(keys)]  # a page found wrong ends what can be reused
        with self._lock:
            self.host_loads.settle()
            self.demoter.await_keys(keys)
            result = self.tree.match_prefix(usable, ns)
            self.host_loads.stream_waits()  # device pages found here may still be arriving
            self.ledger.count_device(result.num_pages, len(keys))
            self.tree.lock(result.node)
            in_host = self._in_host(usable[result.num_pages:])
        try:
            plan = self.tier_loads.plan(usable[result.num_pages:], in_host, self.canary.quarantined(ns))
        except BaseException:
            with self._lock:
                self.tree.unlock(result.node)
            raise
        if reuse_policy:
            plan = self.reuse.worth_loading(keys[result.num_pages:], plan)
        handle = CacheHandle(self.ledger.owner, ns, self.spec.page_size, keys, result.node, result.values,
                             result.num_pages + len(plan), plan, tokens=tokens)
        handle.sources[Tier.DEVICE] = result.num_pages
        with self._lock:
            self.ledger.enroll(handle)
        return handle

    def _in_host(self, keys: list[bytes]) -> list[bool]:
        """Per key: in host RAM, or on its way below and still served from memory (lock held)."""
        return [k in self.host.index or k in self._in_flight for k in keys]

    def put(self, ns: str, keys: list[bytes], tokens: np.ndarray, kv: torch.Tensor) -> int:
        """Store the pages of `keys` the device lacks from `kv` (tensor-API shape, checked); as many
        as fit. Returns the tokens newly stored."""
        ps = self.spec.page_size
        with self._lock:
            match = self.tree.match_prefix(keys, ns)
            if match.num_pages == len(keys):
                return 0
            self.tree.lock(match.node)  # keep the prefix on the device while room is made
            try:
                pages = self.demoter.allocate_fitting(len(keys) - match.num_pages)
            except BaseException:
                self.tree.unlock(match.node)
                raise
            self.ledger.loose += len(pages)
        n, start = len(pages), match.num_pages
        try:
            if n:  # the pages are ours until adopted: the copy needs no lock
                self.pool.write(self.pool.slots(pages, n * ps), kv[:, :, start * ps:(start + n) * ps])
        except BaseException:
            with self._lock:
                self.pool.free(pages)
                self.ledger.loose -= n
                self.tree.unlock(match.node)
            raise
        with self._lock:
            self.tree.unlock(match.node)
            self.ledger.loose -= n
            if not n:
                return 0
            self.ledger.device.bytes_in += n * self.spec.bytes_per_page
            _, _, dup = self.ledger.adopt(ns, keys[:start + n], match.values, pages, tokens)
            self.demoter.after_insert(ns, keys[:start + n], n - dup)
        return (n - dup) * ps

    def prefetch(self, handle: CacheHandle) -> bool:
        """Start staging the handle's pages below the device (lock held); see `TieredCache.prefetch`."""
        if handle.prefetch is not None:
            return True
        start = handle.num_device_pages
        wanted, plan = handle.keys[start:handle.available_pages], handle.plan[:handle.available_pages - start]
        if not wanted:
            return False
        if all(where == HOST for where in plan) or self.arena_loads.in_arenas(plan):
            return False  # `load` copies these straight into the pool: nothing to stage
        pages = None
        if self.tier_loads.fills_pool and HOST not in plan:
            # A CPU pool: the prefetch fills the device pages the load would have (as many as fit),
            # so the load only adopts them. (With pages in host RAM, allocating first could evict
            # them before they are copied: those are staged.)
            def pages() -> np.ndarray:
                got = self.demoter.allocate_fitting(len(wanted))
                self.ledger.loose += len(got)
                return got
        handle.prefetch = self.tier_loads.prefetch(wanted, plan, self.canary.quarantined(handle.namespace), pages)
        return handle.prefetch is not None

    def load(self, handle: CacheHandle) -> np.ndarray:
        """Load the handle's pages below the device into device pages; see `TieredCache.load`."""
        self.host_loads.stream_waits()  # also when there is nothing to load
        with self._lock:
            self.host_loads.settle()
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
        loaded = None
        if pending is not None:
            waited = time.perf_counter()
            try:
                loaded = pending.future.result()
            except Exception:  # a failed prefetch is retried inline, never surfaced as an error
                loaded = None
            if self._live_metrics is not None:
                self._live_metrics.prefetch_wait.observe(time.perf_counter() - waited)
            if pending.pages is not None:
                placed = self._adopt_prefetched(handle, start, pending.pages, loaded)
                if placed is not None:
                    return placed
                loaded = None  # it failed: loaded inline below
        skip = self.canary.quarantined(handle.namespace)  # also when a page is looked for again
        below = loaded is None and HOST not in plan
        direct = below and self.arena_loads.direct(plan)  # asked once: it looks at the tier
        if below and (self.tier_loads.fills_pool or direct):
            # Every page below host RAM, and a CPU pool (or, on CUDA, pages in same-host store
            # arenas): device pages first, then each page is placed straight in its own (one copy or
            # one DMA, no staging); only as many are loaded as fit. (With pages in host RAM,
            # allocating first could evict them before they are copied: the staged path copies
            # them out first.)
            load = self.arena_loads.load if direct else self.tier_loads.load_into_pool
            return self._install(handle, start, len(wanted),
                                 lambda pages: load(wanted[:len(pages)], plan[:len(pages)], pages, skip))
        staged = loaded if loaded is not None else self.tier_loads.load(wanted, plan, skip=skip)

        def from_staging(pages: np.ndarray) -> Loaded:
            self.tier_loads.staged_to_pool(staged, pages)
            return staged

        try:
            return self._install(handle, start, staged.n, from_staging)
        finally:
            self.tier_loads.give_back(staged)

    def _install(self, handle: CacheHandle, start: int, num_pages: int,
                 fill: Callable[[np.ndarray], Loaded]) -> np.ndarray:
        """Allocate up to `num_pages` device pages (as many as fit), have `fill` load the
        prefix's next pages into them, and put the leading ones that arrived into the tree; the
        rest are freed."""
        with self._lock:
            self.ledger.check_live(handle)
            pages = self.demoter.allocate_fitting(num_pages)
            self.ledger.loose += len(pages)
        try:
            filled = fill(pages) if len(pages) else None
        except BaseException:
            self._give_back(pages)
            raise
        return self._keep_arrived(handle, start, pages, filled)

    def _keep_arrived(self, handle: CacheHandle, start: int, pages: np.ndarray, filled: Loaded | None) -> np.ndarray:
        """Of `pages` a load filled for `handle`, the leading ones that arrived into the tree; the
        rest freed (from the first page that did not arrive: never adopted)."""
        n = min(filled.n, len(pages)) if filled is not None else 0
        with self._lock:
            self.ledger.loose -= len(pages)
            if n < len(pages):
                self.pool.free(pages[n:])
            return self._adopt_loaded(handle, start, pages[:n], filled.tiers[:n] if filled is not None else [])

    def _give_back(self, pages: np.ndarray) -> None:
        """Device pages allocated for a fill that will not be adopted: free again."""
        with self._lock:
            self.pool.free(pages)
            self.ledger.loose -= len(pages)

    def _adopt_prefetched(self, handle: CacheHandle, start: int, pages: np.ndarray,
                          loaded: Loaded | None) -> np.ndarray | None:
        """A prefetch's device pages (a CPU pool): the leading ones that arrived into the tree,
        the rest freed. None when the prefetch failed (its pages freed: the load runs inline)."""
        if loaded is None:
            self._give_back(pages)
            return None
        return self._keep_arrived(handle, start, pages, loaded)

    def _load_from_host(self, handle: CacheHandle, start: int, wanted: list[bytes]) -> np.ndarray | None:
        """All of `wanted` in host RAM: copy its rows straight into new device pages, one copy
        instead of two through a staging buffer. The lock is held from finding the rows to the
        end of the copy, so they cannot be evicted or reused meanwhile. When the device is short
        of free pages, cold device pages are demoted first (into host RAM, or below where it is
        full), with the pages being loaded held out of host RAM eviction's reach meanwhile. None
        (nothing done) when host RAM lacks a page or the device cannot make room: `load` then
        takes the staged path."""
        n = len(wanted)
        with self._lock:
            self.ledger.check_live(handle)
            if self.host.contains_prefix(wanted) < n:
                return None
            shortfall = n - self.pool.num_free
            if shortfall > 0:
                if self.tree.size_info().evictable < shortfall:
                    return None
                held = self.host.hold(wanted)  # out of eviction's reach while cold pages come down
                try:
                    self.demoter.demote_now(self.tree.evict(shortfall))
                finally:
                    self.host.unhold(held)
                if self.pool.num_free < n:
                    return None
            pages = self.pool.allocate(n)
            try:
                self.host_loads.to_pool(self.host.leading_rows(wanted), pages)
            except BaseException:
                self.pool.free(pages)
                raise
            return self._adopt_loaded(handle, start, pages, [Tier.HOST.value] * len(pages))

    def _adopt_loaded(self, handle: CacheHandle, start: int, pages: np.ndarray, tiers: list[str]) -> np.ndarray:
        """Pages loaded for `handle` after its first `start`: into the tree, counted (lock held)."""
        n = len(pages)
        for name in tiers:
            handle.sources[name] += 1
        handle.loaded_from += tiers[:n]
        self.moves.loads[Tier.HOST] += tiers.count(Tier.HOST)
        if n:
            self.ledger.device.bytes_in += n * self.spec.bytes_per_page
            node, all_pages, _ = self.ledger.adopt(handle.namespace, handle.keys[:start + n], handle.device_pages,
                                                   pages, handle.tokens)
            self.ledger.move_lock(handle, node)
            handle.device_pages = all_pages
            # Another request may have put some of these keys in the tree first, from host RAM,
            # with its copy still running (the tree keeps its pages, ours are freed): our stream
            # must not read them before that copy ends.
            self.host_loads.stream_waits()
        handle.available_pages = start + n
        handle.plan = []
        self.demoter.maybe_demote()
        return handle.device_pages

    def commit(self, handle: CacheHandle, keys: list[bytes], tokens: Any) -> int:
        """Hand the handle's written pages past its prefix (`keys`: of the tokens to commit) to the
        tree (lock held); see `TieredCache.commit`. Returns the tokens newly cached."""
        start = handle.num_device_pages
        if keys[:start] != handle.keys[:min(start, len(keys))]:
            raise ValueError("commit() tokens do not start with the prefix this handle matched")
        n_new, dup = self.ledger.commit_own(handle, keys, tokens)
        if n_new:
            self.demoter.after_insert(handle.namespace, keys[:start + n_new], n_new - dup)
        return (n_new - dup) * self.spec.page_size

    def cancel(self, prefetch: Prefetch) -> None:
        """A released handle's prefetch: stopped, its staging given back (its device pages freed)
        once it ends."""
        prefetch.cancel.set()
        pages = prefetch.pages
        if pages is None:
            self.tier_loads.give_back_when_done(prefetch.future)
        else:
            prefetch.future.add_done_callback(lambda _: self._give_back(pages))

    def close(self) -> None:
        """Wait for the copies into the pool still running, then stop the loads' threads."""
        with self._lock:
            self.host_loads.settle(wait=True)
        self.tier_loads.close()
        self.arena_loads.close()
