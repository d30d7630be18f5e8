"""`PageLedger`: who holds which device page of one `TieredCache`.

A device page is held by the radix tree (a cached prefix), by a live handle (`own_pages`: a
request's suffix, or a fork's share of it), or by nobody for a moment while a copy fills it
(`loose`: a put or load under way) or the background demoter copies it out (`demoting`). The
pool counts holders per page; `check_integrity` checks the two agree. Everything here runs with
the cache's lock held.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from tiered_cache.cache.handle import CacheHandle
from tiered_cache.cache.page_tokens import PageTokens
from tiered_cache.cache.stats import PoolStats
from tiered_cache.errors import IntegrityError
from tiered_cache.index.radix_node import RadixNode
from tiered_cache.index.radix_results import SizeInfo
from tiered_cache.tiers.base import Tier, TierStats

if TYPE_CHECKING:
    from tiered_cache.device.pool import PagePool
    from tiered_cache.index.radix import RadixTree
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.tiers.host import HostTier


class PageLedger:
    """The tree, the pool and the live handles of one cache, and the figures of their pages."""

    def __init__(self, spec: KVSpec, pool: PagePool, tree: RadixTree, host: HostTier) -> None:
        self.owner = self  # whose handles these are (checked by identity: one ledger per cache)
        self.spec, self.pool, self.tree = spec, pool, tree
        self._host = host  # a swapped-out handle's pages wait in its rows
        self.device = TierStats(Tier.DEVICE.value, capacity_bytes=self.pool.num_pages * self.spec.bytes_per_page)
        self.live: set[CacheHandle] = set()  # handles not released yet: they hold their own pages
        self.loose = 0  # pages allocated outside any holder while a copy fills them (put, load)
        self.demoting = 0  # pages the background demoter took from the tree and has not freed yet
        self.unused_slots = 0  # token slots allocated to live handles and not used yet
        self.forks = 0
        self.cow_copies = 0
        self.pages_compacted = 0  # pages freed by retention policies
        self.page_tokens = PageTokens()  # token ids of inserted pages, for tree() previews

    def adopt(self, ns: str, keys: list[bytes], prefix_pages: np.ndarray, new_pages: np.ndarray,
              tokens: Any) -> tuple[RadixNode, np.ndarray, int]:
        """Insert `keys` held in `prefix_pages` + `new_pages` and hand the new pages to the tree;
        the new pages' token ids (from `tokens`, the whole sequence) are remembered for `prefix_tree`.

        Another request may have cached some of the same pages meanwhile (two handles that
        matched the same prefix): the tree keeps its copies and the duplicates are freed here.
        Returns the node ending at the last key, the tree's pages for all keys, and the number
        of duplicates (the leading new pages the tree already had).
        """
        # Tokens first: the tree's insert tells KV event subscribers, with the pages' tokens.
        self.page_tokens.record(keys, tokens, self.spec.page_size, first=len(prefix_pages))
        inserted = self.tree.insert(keys, np.concatenate([prefix_pages, new_pages]), ns)
        dup = inserted.num_existing - len(prefix_pages)
        if dup <= 0:
            return inserted.node, np.concatenate([prefix_pages, new_pages]), 0
        self.pool.free(new_pages[:dup])
        result = self.tree.match_prefix(keys, ns)
        assert result.num_pages == len(keys)
        return result.node, result.values, dup

    def move_lock(self, handle: CacheHandle, node: RadixNode) -> None:
        """The handle's prefix now ends at `node`: lock it before unlocking the old one."""
        self.tree.lock(node)
        self.tree.unlock(handle.node)
        handle.node = node

    def unused(self, handle: CacheHandle) -> int:
        """Slots allocated to the handle that hold no token yet."""
        return max(0, len(handle.own_pages) * self.spec.page_size - handle.own_tokens)

    @contextmanager
    def reshaping(self, handle: CacheHandle) -> Iterator[None]:
        """Around a change to the handle's own pages or tokens: keeps `unused_slots` true."""
        self.unused_slots -= self.unused(handle)
        yield
        self.unused_slots += self.unused(handle)

    def enroll(self, handle: CacheHandle) -> None:
        """A new live handle (a match or a fork)."""
        self.live.add(handle)
        self.unused_slots += self.unused(handle)

    def check_live(self, handle: CacheHandle, allow_swapped: bool = False) -> None:
        """Raise TypeError / ValueError unless `handle` is a live handle of this cache."""
        if not isinstance(handle, CacheHandle):
            raise TypeError(f"expected a CacheHandle, got {type(handle).__name__}")
        if handle.owner is not self.owner:
            raise ValueError("this cache handle belongs to another TieredCache")
        if handle.released:
            raise ValueError("this cache handle was already released")
        if handle.swapped is not None and not allow_swapped:
            raise ValueError("this cache handle is swapped out: swap_in() it first")

    def commit_own(self, handle: CacheHandle, keys: list[bytes], tokens: Any) -> tuple[int, int]:
        """Hand the handle's leading own pages that `keys` covers (after its prefix) to the tree;
        the handle's prefix then ends after them. Returns (pages handed over, duplicates freed)."""
        start = handle.num_device_pages
        n_new = min(len(keys) - start, len(handle.own_pages))
        if n_new <= 0:
            return 0, 0
        new_pages = np.array(handle.own_pages[:n_new], dtype=np.int64)
        with self.reshaping(handle):
            del handle.own_pages[:n_new]  # from here on the tree owns them (or they are freed as duplicates)
            handle.own_tokens -= n_new * self.spec.page_size
            handle.own_written -= n_new * self.spec.page_size
        node, all_pages, dup = self.adopt(handle.namespace, keys[:start + n_new], handle.device_pages, new_pages,
                                          tokens)
        self.move_lock(handle, node)
        handle.keys, handle.device_pages = keys, all_pages
        handle.available_pages = len(all_pages)
        handle.plan = []
        return n_new, dup

    def retire(self, handle: CacheHandle) -> None:
        """A released handle: its prefix unlocked (a swapped-out one's was then: its host RAM rows
        go back instead), its own pages freed."""
        if handle.swapped is not None:
            swapped, handle.swapped = handle.swapped, None
            self._host.rows.free(swapped.rows)
        else:
            self.tree.unlock(handle.node)
            self.unused_slots -= self.unused(handle)
        if handle.own_pages:
            self.pool.free(np.array(handle.own_pages, dtype=np.int64))
        handle.own_pages.clear()
        handle.own_tokens = handle.own_written = 0
        handle.released = True
        self.live.discard(handle)

    def stats(self) -> tuple[TierStats, PoolStats, SizeInfo, int]:
        """The device tier's figures, the pool's, the tree's sizes and its node count."""
        usage, size = self.pool.usage(), self.tree.size_info()
        device = replace(self.device, pages=size.total, used_bytes=size.total * self.spec.bytes_per_page)
        swapped = sum(len(h.swapped.rows) for h in self.live if h.swapped)
        pool = PoolStats(usage.total_pages, usage.used_pages, usage.free_pages, usage.page_bytes,
                           self.unused_slots, int((self.pool.allocator.refs > 1).sum()), self.forks,
                           self.cow_copies, swapped, self.pages_compacted)
        return device, pool, size, self.tree.num_nodes

    def count_device(self, hits: int, wanted: int) -> None:
        self.device.hits += hits
        self.device.misses += wanted - hits

    def holder_counts(self) -> np.ndarray:
        """Per pool page, the holders the cache knows of: the tree, live handles' own pages."""
        counts = np.zeros(self.pool.num_pages, dtype=np.int64)
        np.add.at(counts, self.tree.all_values(), 1)
        for handle in self.live:
            np.add.at(counts, np.array(handle.own_pages, dtype=np.int64), 1)
        return counts

    def check_integrity(self) -> None:
        """Tree and pool invariants, and page holder counts: every page the tree or a live handle
        holds has exactly that many holders in the pool; pages allocated with no holder are only
        those a copy is filling now (background demotion, a put or load under way)."""
        self.tree.check_integrity()
        self.pool.check_integrity()
        held = self.tree.size_info().total
        if held > self.pool.usage().used_pages:
            raise AssertionError(f"the tree holds {held} pages but only {self.pool.usage().used_pages} are in use")
        counts, refs = self.holder_counts(), self.pool.allocator.refs
        wrong = np.flatnonzero((counts > 0) & (counts != refs))
        if wrong.size:
            raise IntegrityError(f"pages {wrong.tolist()[:16]} have {refs[wrong].tolist()[:16]} holders in the "
                                 f"pool but {counts[wrong].tolist()[:16]} known holders")
        orphans = int(((counts == 0) & (refs > 0)).sum())
        if orphans > self.demoting + self.loose:
            raise IntegrityError(f"{orphans} pages are allocated with no holder ({self.demoting} being "
                                 f"demoted, {self.loose} being filled): leaked")
