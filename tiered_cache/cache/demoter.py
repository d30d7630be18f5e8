"""`Demoter`: room on the device, made by moving cold pages device -> host RAM.

- Inline, when an allocation finds the pool short (`allocate`): the evicted pages are copied
  into host RAM under the lock (only device -> host there; what host RAM drops goes below in the
  background, `lower_writer.py`).
- In the background, above `high_watermark`, down to `low_watermark`: a batch leaves the tree
  under the lock, its pages are copied out without it (no one else can reach them: not in the
  tree, not free), and handed to host RAM and freed under it again, so requests wait for the
  demoter only while it touches metadata. A lookup of a key in such a batch waits for it
  (`await_keys`): the page is in neither place meanwhile.
- Write-through: new pages are copied to host RAM in the background, then queued below.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from tiered_cache.cache.background import BackgroundQueue, QueueOwner
from tiered_cache.cache.foreground import YIELD_S
from tiered_cache.cache.handle import CacheHandle
from tiered_cache.config import WritePolicy
from tiered_cache.device.writer_streams import WriterStreams
from tiered_cache.errors import PoolExhaustedError
from tiered_cache.index.radix_results import EvictedNode
from tiered_cache.tiers.base import Tier

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore

_NO_PAGES = np.empty(0, dtype=np.int64)
_BATCH = 64  # pages the background demoter moves per pass of the lock


class Demoter(QueueOwner):
    """Makes room on the device of one cache (see the module doc)."""

    def __init__(self, core: CacheCore) -> None:
        super().__init__(BackgroundQueue("demoter", capacity=max(2, core.config.demotion_queue)))
        self.core = core
        self.config, self.ledger, self.moves = core.config, core.ledger, core.moves
        self.spec, self.pool, self.tree, self.host = core.spec, core.pool, core.tree, core.host
        self.copier, self.writer = core.copier, core.writer
        self._lock = core.lock
        self._demoting_keys: set[bytes] = set()  # keys of pages in `ledger.demoting`
        self._demoted = threading.Condition(core.lock)  # notified when the demoter frees its pages
        self.idle = core.demotions_idle  # set while no demotion is queued or running: the writer waits for it
        self.writers = WriterStreams(self.pool.device)  # background copies wait for the writers' streams

    # --- allocation (lock held) --------------------------------------------------------------------
    def allocate(self, n: int) -> np.ndarray:
        """`n` device pages, evicting (inline) when the pool is short: pages safe below are
        dropped, the rest copied device -> host (`demote_now`)."""
        self._await_demoter(n)
        shortfall = n - self.pool.num_free
        if shortfall > 0:
            self.demote_now(self.tree.evict(shortfall))
        if not self.pool.can_allocate(n):
            self._release_pinned()
        if not self.pool.can_allocate(n):
            raise PoolExhaustedError(n, self.pool.num_free, self.pool.num_pages)
        return self.pool.allocate(n)

    def allocate_for(self, handle: CacheHandle, num_tokens: int) -> np.ndarray:
        """New device pages for `num_tokens` more tokens of the handle's own (its last page's free
        slots first); see `TieredCache.allocate`. Takes the lock."""
        with self._lock:
            self.ledger.check_live(handle)
            needed = self.spec.pages_for_tokens(handle.own_tokens + num_tokens) - len(handle.own_pages)
            pages = self.allocate(max(0, needed))
            with self.ledger.reshaping(handle):
                handle.own_pages.extend(pages.tolist())
                handle.own_tokens += num_tokens
            self.maybe_demote()
        return pages

    def allocate_fitting(self, n: int) -> np.ndarray:
        """Up to `n` device pages: as many as free and evictable pages allow."""
        self._await_demoter(n)
        room = self.pool.num_free + self.tree.size_info().evictable
        if n > room and self._release_pinned():
            room = self.pool.num_free + self.tree.size_info().evictable
        return self.allocate(min(n, room)) if n else _NO_PAGES

    def _release_pinned(self) -> bool:
        """Pages freed while a copy into them still ran are neither free nor evictable: wait for
        those copies so they are free again. Whether there were any."""
        if not self.pool.allocator.num_pending:
            return False
        # Waits for the copies into device pages still running and releases the pages they pinned.
        self.core.host_loads.settle(wait=True)
        return True

    def await_keys(self, keys: list[bytes]) -> None:
        """Wait (briefly, lock released meanwhile) while the background demoter is moving any of
        `keys` from the device to host RAM: they are in neither place until it is done."""
        if self._demoting_keys and not self._demoting_keys.isdisjoint(keys):
            self._demoted.wait_for(lambda: self._demoting_keys.isdisjoint(keys), timeout=1.0)

    def _await_demoter(self, n: int) -> None:
        """When `n` pages cannot be had from free and evictable pages, but the background demoter
        holds pages it is about to free, wait for them (briefly, lock released meanwhile). A
        request that can make its own room never waits for a demotion of pages it does not read:
        evicting inline mostly drops pages already safe below (`demote_now`)."""
        if self.ledger.demoting and n > self.pool.num_free + self.tree.size_info().evictable:
            self._demoted.wait_for(lambda: not self.ledger.demoting or n <= self.pool.num_free, timeout=1.0)

    # --- inline demotion (lock held) -----------------------------------------------------------------
    def evict(self, num_pages: int | None) -> int:
        """Move up to `num_pages` unlocked device pages (all when None) down to host RAM, least
        recently used first; returns how many were moved (`TieredCache.evict`)."""
        tree = self.ledger.tree
        evicted = tree.evict(tree.size_info().evictable if num_pages is None else num_pages)
        self.demote_now(evicted)
        return sum(len(node.keys) for node in evicted)

    def demote_now(self, evicted: list[EvictedNode]) -> None:
        """Evicted nodes' pages, on the request path: copy into host RAM only those neither host RAM
        nor a lower tier holds, then free them all. A page safe below is dropped, not copied: the
        request pays for no copy it does not need (host RAM keeps copies of pages it is meant to:
        the background demoter copies them ahead of need, above the high watermark)."""
        if not evicted:
            return
        keys = [k for node in evicted for k in node.keys]
        pages = np.concatenate([node.values for node in evicted])
        try:
            below = self.writer.chain.known_anywhere(keys)
            unhosted = [i for i, k in enumerate(keys) if k not in self.host.index]
            missing = [i for i in unhosted if not below[i]]
            self.moves.uncopied_evictions += len(unhosted) - len(missing)
            if missing:
                chosen = [keys[i] for i in missing]
                new, rows, overflow = self.host.reserve(chosen)
                spill, copied = None, False
                try:
                    spill = self._pages_to_rows(pages[missing], new, rows, overflow)
                    copied = True
                finally:
                    self._fill_or_free(chosen, new, rows, copied)
                if spill is not None:
                    self.writer.host_evicted([chosen[i] for i in overflow], spill)
                self.ledger.device.bytes_out += len(missing) * self.spec.bytes_per_page
        finally:  # out of the tree either way: a failed copy loses those pages, never leaks them
            self.pool.free(pages)
            self.ledger.device.evictions += len(keys)

    def _pages_to_rows(self, pages: np.ndarray, new: list[int], rows: np.ndarray,
                        overflow: list[int], background: bool = False) -> torch.Tensor | None:
        """Copy device `pages[new]` into reserved host `rows` (one DMA per run of rows on CUDA, no
        staging), and return a host copy of `pages[overflow]` (no room in host RAM) for below.
        `background`: a request's copy waits behind one chunk of this one, not all of it."""
        if new:
            self.host.before_write()
            # The pages' KV, written on any request's stream, is complete before the copy reads it.
            self.copier.from_pool(pages[new], self.host.slab, rows, background=background,
                                  after=self.writers.pending())
        if not overflow:
            return None
        self.writers.wait_on_current()
        with torch.inference_mode(False):
            return self.pool.gather(pages[overflow], out=torch.empty(self.spec.staging_shape(len(overflow)),
                                                                     dtype=self.pool.kv.dtype))

    def _fill_or_free(self, keys: list[bytes], new: list[int], rows: np.ndarray, copied: bool) -> None:
        """Reserved host rows after a copy into them (lock held): indexed under their keys when the
        copy finished, else freed. Host RAM has no checksum: a row the copy never wrote must never
        be read as KV."""
        if copied:
            self.host.fill([keys[i] for i in new], rows)
            self.moves.demotions[Tier.HOST] += len(new)
        else:
            self.host.rows.free(rows)

    # --- background demotion -------------------------------------------------------------------------
    def after_insert(self, ns: str, keys: list[bytes], num_new: int) -> None:
        """New pages entered the tree (lock held). Write-through queues a copy to host RAM and
        every lower tier; the request path itself copies nothing."""
        self.writers.mark()
        if self.config.write_policy is WritePolicy.WRITE_THROUGH and num_new > 0:
            self.queue.submit(self._write_through, ns, keys, num_new)
        self.maybe_demote()

    def maybe_demote(self) -> None:
        """Above the high watermark, have the background demoter bring the pool down to the low one."""
        used = self.pool.usage().used_pages
        if self.idle.is_set() and used > self.config.high_watermark * self.pool.num_pages:
            self.idle.clear()
            if not self.queue.submit(self._demote_to_low_watermark):
                self.idle.set()

    def _demote_to_low_watermark(self) -> None:
        """Background: move cold pages device -> host RAM in batches until the low watermark."""
        try:
            while True:
                self.core.foreground.wait_idle(YIELD_S)
                with self._lock:
                    excess = self.pool.usage().used_pages - int(self.config.low_watermark * self.pool.num_pages)
                    if excess <= 0 or self.core.closed:
                        return
                    evicted = self.tree.evict(min(excess, _BATCH))
                    if not evicted:
                        return
                    keys = [k for node in evicted for k in node.keys]
                    pages = np.concatenate([node.values for node in evicted])
                    missing = [i for i, k in enumerate(keys) if k not in self.host.index]
                    self.ledger.demoting += len(pages)
                    self._demoting_keys.update(keys)
                    chosen = [keys[i] for i in missing]
                    new, rows, overflow = self.host.reserve(chosen)  # host rows now ours too
                spill, copied = None, False
                try:
                    # No lock: no one else can reach these pages (out of the tree, not free) or
                    # these rows (allocated, not indexed).
                    spill = self._pages_to_rows(pages[missing], new, rows, overflow, background=True)
                    copied = True
                finally:
                    with self._lock:
                        self._fill_or_free(chosen, new, rows, copied)
                        if overflow and spill is not None:
                            self.writer.host_evicted([chosen[i] for i in overflow], spill)
                        self.ledger.device.bytes_out += len(missing) * self.spec.bytes_per_page
                        self.pool.free(pages)
                        self.ledger.device.evictions += len(keys)
                        self.ledger.demoting -= len(pages)
                        self._demoting_keys.difference_update(keys)
                        self._demoted.notify_all()
        finally:
            self.idle.set()

    def _write_through(self, ns: str, keys: list[bytes], num_new: int) -> None:
        """Background: copy the last `num_new` pages of `keys` to host RAM, then queue them below.
        Pages evicted meanwhile were copied to host RAM by the eviction: they are read from there.
        The device -> host copy runs outside the lock (the node is locked so its pages stay, the
        rows are reserved so no one else uses them): a request never waits behind it."""
        first = len(keys) - num_new
        self.core.foreground.wait_idle(YIELD_S)
        with self._lock:
            if self.core.closed:
                return
            match = self.tree.match_prefix(keys, ns)
            on_device = max(first, match.num_pages)
            chosen = [k for k in keys[first:on_device] if k not in self.host.index]
            positions = [first + i for i, k in enumerate(keys[first:on_device]) if k not in self.host.index]
            pages = match.values[positions] if positions else _NO_PAGES
            new, rows, overflow = self.host.reserve(chosen)
            self.tree.lock(match.node)
        spill, copied = None, False
        try:
            spill = self._pages_to_rows(pages, new, rows, overflow, background=True)
            copied = True
        finally:
            with self._lock:
                self.tree.unlock(match.node)
                self._fill_or_free(chosen, new, rows, copied)
                if spill is not None:
                    self.writer.host_evicted([chosen[i] for i in overflow], spill)
                in_host = self.host.contains_prefix(keys[first:])
        if self.writer.chain.tiers and in_host:
            self.writer.queue_host_pages(keys[first:first + in_host], range(len(self.writer.chain.tiers)))
