"""Copy-on-write forks of a request's pages (parallel sampling, beam search): `TieredCache.fork`.

A fork shares every device page of its parent: the matched prefix through a lock on the same
radix node (the tree owns those pages and never changes them), and the parent's own pages
through holder counts on the pool's pages (`PageAllocator.share`). Writes go only after what a
handle has written, so the one page a write can meet shared is the partly written last page (or
pages allocated but not yet written when it forked): the first write into a shared page copies
that page alone into a fresh one (`PagePool.copy_pages`: the copy kernel on CUDA, torch on the
CPU). Sharing therefore costs at most one page per sequence over the parent's pages.

Every method here runs with the cache's lock held, on a handle the cache checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tiered_cache.cache.demoter import Demoter
from tiered_cache.cache.handle import CacheHandle

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore


class Forks:
    """Forks of handles and the copy-on-write that keeps their writes apart; see the module doc."""

    def __init__(self, core: CacheCore, demoter: Demoter) -> None:
        self.ledger = core.ledger
        self.spec, self.pool, self.tree = core.spec, core.pool, core.tree
        self.demoter = demoter

    def fork(self, handle: CacheHandle, n: int) -> list[CacheHandle]:
        """`n` new live handles sharing the handle's prefix and own pages."""
        own = np.array(handle.own_pages, dtype=np.int64)
        if own.size:
            self.pool.share(np.tile(own, n))
        children = []
        for _ in range(n):
            self.tree.lock(handle.node)
            child = CacheHandle(handle.owner, handle.namespace, handle.page_size, list(handle.keys), handle.node,
                                handle.device_pages.copy(), handle.num_device_pages,
                                own_pages=list(handle.own_pages), own_tokens=handle.own_tokens,
                                own_written=handle.own_written, tokens=handle.tokens)
            child.sources.update(handle.sources)
            child.dropped, child.compacted = handle.dropped.copy(), handle.compacted
            self.ledger.enroll(child)
            children.append(child)
        self.ledger.forks += n
        return children

    def make_private(self, handle: CacheHandle, first: int, end: int) -> None:
        """Copy-on-write: replace the handle's own pages that hold tokens [first, end) of its
        suffix and are shared with another holder by private copies of them."""
        ps = self.spec.page_size
        span = self._own_span(handle, first, end)
        shared = np.flatnonzero(self.pool.allocator.is_shared(span)) if span.size else span
        if not shared.size:
            return
        fresh = self.demoter.allocate(len(shared))
        self.pool.copy_pages(span[shared], fresh)
        self.pool.free(span[shared])  # one holder fewer; the others keep the original
        for i, page in zip(shared.tolist(), fresh.tolist(), strict=True):
            handle.own_pages[first // ps + i] = page
        self.ledger.cow_copies += len(shared)

    def require_private(self, handle: CacheHandle, first: int, end: int) -> None:
        """Raise ValueError if tokens [first, end) of the handle's suffix lie in a shared page: an
        engine wrote there without `writable_slots`, and a fork would see its writes."""
        span = self._own_span(handle, first, end)
        if span.size and self.pool.allocator.is_shared(span).any():
            raise ValueError("mark_written() over a page a fork shares: get the slots from writable_slots() "
                             "(it copies shared pages first), write there, then mark_written()")

    def _own_span(self, handle: CacheHandle, first: int, end: int) -> np.ndarray:
        """The handle's own pages that hold tokens [first, end) of its suffix (none when empty)."""
        if end <= first:
            return np.empty(0, dtype=np.int64)
        ps = self.spec.page_size
        return np.array(handle.own_pages[first // ps:-(-end // ps)], dtype=np.int64)
