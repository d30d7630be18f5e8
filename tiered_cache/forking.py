"""Copy-on-write forks of a request's pages (parallel sampling, beam search): `TieredCache.fork`.

A fork shares every device page of its parent: the matched prefix through a lock on the same
radix node (the tree owns those pages and never changes them), and the parent's own pages
through holder counts on the pool's pages (`PageAllocator.share`). Writes go only after what a
handle has written, so the one page a write can meet shared is the partly written last page (or
pages allocated but not yet written when it forked): the first write into a shared page copies
that page alone into a fresh one (`PagePool.copy_pages`: the copy kernel on CUDA, torch on the
CPU). Sharing therefore costs at most one page per sequence over the parent's pages.

Mixed into `TieredCache`; every method here runs with or takes its lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tiered_cache.handle import CacheHandle


class ForkOps:
    """`fork`, `writable_slots` and the copy-on-write behind `write`; see the module doc."""

    _lock: Any
    pool: Any
    spec: Any

    def fork(self, handle: CacheHandle, n: int) -> list[CacheHandle]:
        """`n` new handles that each continue the sequence `handle` holds: they share its matched
        prefix and its own pages (written or only allocated), and each writes, commits and is
        released on its own. The parent stays live (release it when done). Pages found below the
        device and not loaded yet are not shared: `load()` before forking to share them.
        Raises ValueError for n < 1 or a handle that is not live."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"fork() needs a positive number of forks, got {n!r}")
        with self._lock:
            self._check_live(handle)  # type: ignore[attr-defined]
            own = np.array(handle.own_pages, dtype=np.int64)
            if own.size:
                self.pool.share(np.tile(own, int(n)))
            children = []
            for _ in range(int(n)):
                self.tree.lock(handle.node)  # type: ignore[attr-defined]
                child = CacheHandle(self, handle.namespace, handle.page_size, list(handle.keys), handle.node,
                                    handle.device_pages.copy(), handle.num_device_pages,
                                    own_pages=list(handle.own_pages), own_tokens=handle.own_tokens,
                                    own_written=handle.own_written, tokens=handle.tokens)
                child.sources.update(handle.sources)
                child.dropped, child.compacted = handle.dropped.copy(), handle.compacted
                self._live.add(child)  # type: ignore[attr-defined]
                self._unused_slots += self._handle_unused(child)  # type: ignore[attr-defined]
                children.append(child)
            self._forks += int(n)
        return children

    def writable_slots(self, handle: CacheHandle, num_tokens: int) -> np.ndarray:
        """Flat pool slots for the handle's next `num_tokens` tokens (after those written), for an
        engine that writes K/V into `pool.kv` itself and then calls `mark_written`. Pages there
        that a fork shares are copied first, so the writes reach this sequence alone."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        with self._lock:
            self._check_writable(handle, int(num_tokens))  # type: ignore[attr-defined]
            self._make_private(handle, handle.own_written, handle.own_written + int(num_tokens))
            slots = self.pool.slots(np.array(handle.own_pages, dtype=np.int64), handle.own_written + int(num_tokens))
        return slots[handle.own_written:]

    def _make_private(self, handle: CacheHandle, first: int, end: int) -> None:
        """Copy-on-write (lock held): replace the handle's own pages that hold tokens [first, end)
        of its suffix and are shared with another holder by private copies of them."""
        ps = self.spec.page_size
        span = self._own_span(handle, first, end)
        shared = np.flatnonzero(self.pool.allocator.is_shared(span)) if span.size else span
        if not shared.size:
            return
        fresh = self._allocate(len(shared))  # type: ignore[attr-defined]
        self.pool.copy_pages(span[shared], fresh)
        self.pool.free(span[shared])  # one holder fewer; the others keep the original
        for i, page in zip(shared.tolist(), fresh.tolist(), strict=True):
            handle.own_pages[first // ps + i] = page
        self._cow_copies += len(shared)

    def _require_private(self, handle: CacheHandle, first: int, end: int) -> None:
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

    def _holder_counts(self) -> np.ndarray:
        """Per pool page, the holders the cache knows of: the tree, live handles' own pages (lock held)."""
        counts = np.zeros(self.pool.num_pages, dtype=np.int64)
        np.add.at(counts, self.tree.all_values(), 1)  # type: ignore[attr-defined]
        for handle in self._live:  # type: ignore[attr-defined]
            np.add.at(counts, np.array(handle.own_pages, dtype=np.int64), 1)
        return counts
