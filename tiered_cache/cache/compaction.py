"""Dropping tokens from a request's private KV (retention policies: retention.py): `TieredCache.
live_slots` and `TieredCache.drop_tokens`.

A handle's tokens, in order, are its matched prefix (tree pages: shared, never altered) and then
its own written tokens. A policy drops own tokens; a page whose every slot is dropped is freed and
leaves the handle's page list, so the handle's own tokens are renumbered over the pages that are
left ("compacted": token j lives in page `own_pages[j // page_size]`, offset `j % page_size`, as
before), and the dropped tokens of pages still live are remembered in `handle.dropped`. Once a
token is dropped the sequence is no longer the KV of its tokens: `commit` refuses it, so a
compacted sequence never enters the radix tree or any tier.

Every method here runs with the cache's lock held, on a handle the cache checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tiered_cache.cache.forks import Forks
from tiered_cache.cache.handle import CacheHandle

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore


class Compaction:
    """Dropping tokens from handles' own pages; see the module doc."""

    def __init__(self, core: CacheCore, forks: Forks) -> None:
        self.ledger = core.ledger
        self.spec, self.pool = core.spec, core.pool
        self.forks = forks

    def live_slots(self, handle: CacheHandle) -> np.ndarray:
        """Flat pool slots of the handle's live tokens in order."""
        prefix = self.pool.slots(handle.device_pages, handle.prefix_tokens)
        own = self.pool.slots(np.array(handle.own_pages, dtype=np.int64), handle.own_written)
        if handle.dropped.size:
            own = np.delete(own, handle.dropped)
        return np.concatenate([prefix, own])

    def drop(self, handle: CacheHandle, live_indices: Any) -> int:
        """Drop the tokens at `live_indices` (positions in `live_slots`); returns the pages freed."""
        indices = np.unique(np.asarray(live_indices, dtype=np.int64))
        if not indices.size:
            return 0
        prefix = handle.prefix_tokens
        own_live = np.setdiff1d(np.arange(handle.own_written, dtype=np.int64), handle.dropped)
        if indices[0] < prefix:
            raise ValueError(f"drop_tokens(): tokens {indices[indices < prefix].tolist()[:8]} belong to the "
                             f"shared prefix ({prefix} tokens), which is never altered")
        if indices[-1] >= prefix + own_live.size:
            raise ValueError(f"drop_tokens(): index {int(indices[-1])} is past the {prefix + own_live.size} "
                             "live written tokens")
        handle.dropped = np.union1d(handle.dropped, own_live[indices - prefix])
        handle.compacted = True
        freed = self._free_dead_pages(handle)
        if self._worth_repacking(handle):
            freed += self._repack(handle)
        return freed

    def _worth_repacking(self, handle: CacheHandle) -> bool:
        """Dropped tokens scattered over pages (HeavyHitter) hold more than one page beyond what
        the live tokens need, and no allocated slot waits for a write."""
        live = handle.own_written - handle.dropped.size
        return (handle.own_tokens == handle.own_written
                and len(handle.own_pages) > self.spec.pages_for_tokens(live) + 1)

    def _repack(self, handle: CacheHandle) -> int:
        """Move the live own tokens, in order, to the front of the handle's pages and free the
        pages left empty; returns the pages freed."""
        own = np.array(handle.own_pages, dtype=np.int64)
        source = np.delete(self.pool.slots(own, handle.own_written), handle.dropped)
        kv = self.pool.read_slots(source)  # a copy: the moves below overlap the source
        live = len(source)
        self.forks.make_private(handle, 0, live)  # forks keep their pages
        own = np.array(handle.own_pages, dtype=np.int64)
        self.pool.write(self.pool.slots(own, live), kv)
        keep = self.spec.pages_for_tokens(live)
        with self.ledger.reshaping(handle):
            self.pool.free(own[keep:])
            del handle.own_pages[keep:]
            handle.own_tokens = handle.own_written = live
            handle.dropped = np.empty(0, dtype=np.int64)
        self.ledger.pages_compacted += len(own) - keep
        return len(own) - keep

    def _free_dead_pages(self, handle: CacheHandle) -> int:
        """Free the handle's own pages whose every slot is written and dropped; renumber."""
        ps = self.spec.page_size
        per_page = np.bincount(handle.dropped // ps, minlength=len(handle.own_pages))
        dead = np.flatnonzero(per_page == ps)
        if not dead.size:
            return 0
        with self.ledger.reshaping(handle):
            self.pool.free(np.array(handle.own_pages, dtype=np.int64)[dead])
            keep = np.isin(handle.dropped // ps, dead, invert=True)
            remaining = handle.dropped[keep]
            handle.dropped = remaining - ps * np.searchsorted(dead, remaining // ps)  # shift over freed pages
            for page in sorted(dead.tolist(), reverse=True):
                del handle.own_pages[page]
            handle.own_tokens -= ps * dead.size
            handle.own_written -= ps * dead.size
        self.ledger.pages_compacted += int(dead.size)
        return int(dead.size)
