"""Preemption by swap: `TieredCache.swap_out` / `swap_in` move a running request's private pages
to host RAM and back.

`swap_out` copies the handle's own pages (written, not committed; through pinned staging on
CUDA) into host RAM rows set aside for it, frees its device pages and unlocks its matched
prefix: a swapped request holds no device page. Its prefix stays in the radix tree, evictable
like any other, and flows down the tiers. `swap_in` matches the prefix again (loading it from
host RAM or below if it was evicted meanwhile), allocates fresh device pages for the private
ones, possibly other pages than before, and the handle's page list follows. Either call changes
nothing when it cannot finish (SwapError, or PoolExhaustedError from the device).

Swap rows come out of host RAM's slab (cached pages there are evicted down the tiers to make
room; pages already on their way down or other swaps are not): when host RAM cannot hold them,
`swap_out` raises SwapError and the engine drops and recomputes the request instead.

Every method here runs with the cache's lock held, on a handle the cache checked, except `swap_in`,
which matches and loads the prefix again through the cache and takes the lock itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tiered_cache.cache.demoter import Demoter
from tiered_cache.cache.handle import CacheHandle
from tiered_cache.cache.staging import StagingBuffers
from tiered_cache.errors import SwapError

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore


@dataclass
class SwappedPages:
    """Where a swapped-out handle's private pages wait: host RAM rows, in `own_pages` order."""

    rows: np.ndarray
    prefix_pages: int  # pages of the matched prefix to find again on swap_in


class Swaps:
    """Moves handles' own pages to host RAM and back; see the module doc."""

    def __init__(self, core: CacheCore, demoter: Demoter, staging: StagingBuffers) -> None:
        self._lock = core.lock
        self.ledger, self.pool, self.tree, self.host = core.ledger, core.pool, core.tree, core.host
        self.demoter = demoter
        self.staging = staging  # the loads' (pinned on CUDA): a swap copies through it

    def swap_out(self, handle: CacheHandle) -> int:
        """Move the handle's own pages to host RAM and free its device pages; returns the pages
        moved. Raises SwapError (nothing changed) when host RAM cannot hold them."""
        own = np.array(handle.own_pages, dtype=np.int64)
        n = len(own)
        evictable = len(self.host.index)  # cached pages in host RAM can move down to make room
        if n > self.host.rows.num_free + evictable:
            raise SwapError(f"host RAM cannot hold this request's {n} pages: {self.host.rows.num_free} of "
                            f"{self.host.num_rows} rows free, {evictable} more evictable (the rest hold "
                            "other swapped requests or pages on their way down); drop and recompute it, or "
                            "raise host_capacity")
        self.host.make_room(n)  # cached pages move down the tiers; retained ones may not free a row
        if self.host.rows.num_free < n:
            raise SwapError(f"host RAM could not free {n} rows for this request; drop and recompute it")
        rows = self.host.rows.allocate(n)
        if n:
            buffer = self.staging.lease(n)
            try:
                staged = buffer[:n]
                self.pool.gather(own, out=staged)
                self.host.copy_in(rows, staged)
            finally:
                self.staging.give_back(buffer)
        self.ledger.unused_slots -= self.ledger.unused(handle)
        self.pool.free(own)  # a fork sharing a page keeps it
        handle.own_pages = []
        self.tree.unlock(handle.node)
        handle.swapped = SwappedPages(rows, handle.num_device_pages)
        return n

    def swap_in(self, handle: CacheHandle, match: Callable[[str, list[bytes], Any], CacheHandle],
                load: Callable[[CacheHandle], np.ndarray], release: Callable[[CacheHandle], None]) -> np.ndarray:
        """Bring a swapped-out handle (checked live) back, with the cache's `match` (on keys), `load`
        and `release`; takes the lock itself. See `TieredCache.swap_in`."""
        swapped = handle.swapped
        if swapped is None:
            raise SwapError("this handle is not swapped out")
        keys = handle.keys[:swapped.prefix_pages]
        found = match(handle.namespace, keys, handle.tokens)
        try:
            pages = load(found) if found.available_pages > found.num_device_pages else found.device_pages
            if len(pages) < len(keys):
                raise SwapError(f"swap_in(): {len(keys) - len(pages)} of the request's {len(keys)} prefix pages "
                                "are no longer cached in any tier; drop and recompute the request")
            with self._lock:
                return self._restore(handle, found, swapped)
        except BaseException:
            if not found.released and handle.swapped is not None:
                release(found)
            raise

    def _restore(self, handle: CacheHandle, found: CacheHandle, swapped: SwappedPages) -> np.ndarray:
        """`found` (the handle's prefix, matched and loaded again) becomes the handle's prefix and
        its own pages come back from host RAM into fresh device pages; returns those pages."""
        n = len(swapped.rows)
        own = self.demoter.allocate(n)
        self.pool.scatter_rows(own, self.host.slab, swapped.rows)
        self.host.rows.free(swapped.rows)
        self.ledger.live.discard(found)  # its lock is the handle's now
        handle.node, handle.device_pages = found.node, found.device_pages
        handle.available_pages, handle.plan = found.num_device_pages, []
        handle.own_pages = own.tolist()
        handle.swapped = None
        self.ledger.unused_slots += self.ledger.unused(handle)
        return own
