"""Preemption by swap: `TieredCache.swap_out` / `swap_in` move a running request's private pages
to host RAM and back.

`swap_out` copies the handle's own pages (written, not committed; through pinned staging on
CUDA) into host RAM slots set aside for it, frees its device pages and unlocks its matched
prefix: a swapped request holds no device page. Its prefix stays in the radix tree, evictable
like any other, and flows down the tiers. `swap_in` matches the prefix again (loading it from
host RAM or below if it was evicted meanwhile), allocates fresh device pages for the private
ones, possibly other pages than before, and the handle's page list follows. Either call changes
nothing when it cannot finish (SwapError, or PoolExhaustedError from the device).

Swap slots come out of host RAM's slab (cached pages there are evicted down the tiers to make
room; pages already on their way down or other swaps are not): when host RAM cannot hold them,
`swap_out` raises SwapError and the engine drops and recomputes the request instead.

Mixed into `TieredCache`; every method here takes its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tiered_cache.errors import SwapError
from tiered_cache.handle import CacheHandle


@dataclass
class SwappedPages:
    """Where a swapped-out handle's private pages wait: host RAM slots, in `own_pages` order."""

    slots: np.ndarray
    prefix_pages: int  # pages of the matched prefix to find again on swap_in


class SwapOps:
    """`swap_out` and `swap_in`; see the module doc."""

    _lock: Any
    pool: Any
    spec: Any
    host: Any

    def swap_out(self, handle: CacheHandle) -> int:
        """Move the handle's own pages to host RAM and free its device pages; returns the pages
        moved. Raises SwapError (nothing changed) when host RAM cannot hold them."""
        with self._lock:
            self._check_live(handle)  # type: ignore[attr-defined]  # refuses one swapped out already
            own = np.array(handle.own_pages, dtype=np.int64)
            n = len(own)
            evictable = len(self.host.index)  # cached pages in host RAM can move down to make room
            if n > self.host.slots.num_free + evictable:
                raise SwapError(f"host RAM cannot hold this request's {n} pages: {self.host.slots.num_free} of "
                                f"{self.host.num_slots} slots free, {evictable} more evictable (the rest hold "
                                "other swapped requests or pages on their way down); drop and recompute it, or "
                                "raise host_capacity")
            self.host.make_room(n)  # cached pages move down the tiers; retained ones may not free a slot
            if self.host.slots.num_free < n:
                raise SwapError(f"host RAM could not free {n} slots for this request; drop and recompute it")
            slots = self.host.slots.allocate(n)
            if n:
                buffer = self._staging.lease(n)  # type: ignore[attr-defined]
                try:
                    staged = buffer[:n]
                    self.pool.gather(own, out=staged)
                    self.host.copy_in(slots, staged)
                finally:
                    self._staging.give_back(buffer)  # type: ignore[attr-defined]
            self._unused_slots -= self._handle_unused(handle)  # type: ignore[attr-defined]
            self.pool.free(own)  # a fork sharing a page keeps it
            handle.own_pages = []
            self.tree.unlock(handle.node)  # type: ignore[attr-defined]
            handle.swapped = SwappedPages(slots, handle.num_device_pages)
            return n

    def swap_in(self, handle: CacheHandle) -> np.ndarray:
        """Bring a swapped-out handle back: its prefix matched (and loaded) again, its own pages
        copied into fresh device pages. Returns the handle's own pages. Raises SwapError when
        the prefix is no longer cached anywhere, PoolExhaustedError when the device has no room;
        either way the handle stays swapped out, unchanged."""
        with self._lock:
            self._check_live(handle, allow_swapped=True)  # type: ignore[attr-defined]
            swapped = handle.swapped
            if swapped is None:
                raise SwapError("this handle is not swapped out")
        keys = handle.keys[:swapped.prefix_pages]
        found = self._match_keys(handle.namespace, keys, handle.tokens)  # type: ignore[attr-defined]
        try:
            pages = self.load(found) if found.available_pages > found.num_device_pages else found.device_pages  # type: ignore[attr-defined]
            if len(pages) < len(keys):
                raise SwapError(f"swap_in(): {len(keys) - len(pages)} of the request's {len(keys)} prefix pages "
                                "are no longer cached in any tier; drop and recompute the request")
            with self._lock:
                n = len(swapped.slots)
                own = self._allocate(n)  # type: ignore[attr-defined]
                self.pool.scatter_rows(own, self.host.slab, swapped.slots)
                self.host.slots.free(swapped.slots)
                self._live.discard(found)  # type: ignore[attr-defined]  # its lock is the handle's now
                handle.node, handle.device_pages = found.node, found.device_pages
                handle.available_pages, handle.plan = found.num_device_pages, []
                handle.own_pages = own.tolist()
                handle.swapped = None
                self._unused_slots += self._handle_unused(handle)  # type: ignore[attr-defined]
                return own
        except BaseException:
            if not found.released and handle.swapped is not None:
                self.release(found)  # type: ignore[attr-defined]
            raise

    def _release_swapped(self, handle: CacheHandle) -> None:
        """A swapped-out handle is released: its host RAM slots go back (lock held)."""
        swapped, handle.swapped = handle.swapped, None
        self.host.slots.free(swapped.slots)
