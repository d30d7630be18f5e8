"""`ArenaLoads`: pages that lie in same-host store servers' arenas, straight into device pages.

A store server on this host keeps its RAM tier in shared memory its clients map read-only
(shm/arena.py); a tier that reads such arenas (`tiers.base.ReadsArenas`) says where each page
lies. On CUDA a load DMAs those pages from there into its device pages, one DMA per run of
adjacent blobs, checked on CPU threads meanwhile (`device/arena_copy.py`; a map the driver will
not register is staged through pinned host chunks there); the arenas are registered with the
driver as they are mapped (`RegisterAhead`), not by the first load that reads one. On a CPU pool
`TierLoads.load` into device pages already copies them from where they lie (one copy), so
this path is CUDA's alone; either way a prefetch into staging would only add a copy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tiered_cache.cache.handle import HOST
from tiered_cache.cache.tier_loads import Loaded, TierLoads
from tiered_cache.device.arena_copy import ArenaCopier
from tiered_cache.device.arena_registry import RegisterAhead, cuda_registry
from tiered_cache.tiers.base import ReadsArenas

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore


class ArenaLoads:
    """Loads from same-host arenas of one cache (see the module doc)."""

    def __init__(self, core: CacheCore, tier_loads: TierLoads) -> None:
        self.tier_loads = tier_loads  # the staged path, for the pages past those read in place
        self.pool, self.chain = core.pool, core.chain
        self._observe = core.reuse.observe  # (tier, seconds, pages): the reuse policy's sample
        self.copier: ArenaCopier | None = None  # made when a same-host store is first read
        cuda = self.pool.kv.device.type == "cuda"
        reads_arenas = any(isinstance(tier, ReadsArenas) for tier in self.chain.tiers)
        self._register_ahead = RegisterAhead(cuda_registry(self.pool.device)) if cuda and reads_arenas else None

    def in_arenas(self, plan: Sequence[int]) -> bool:
        """Whether these planned pages are read in place in same-host arenas: the leading page's
        tier reads arenas of servers on this host, and nothing is planned from host RAM."""
        if not plan or HOST in plan:
            return False
        tier = self.chain.tiers[plan[0]]
        return isinstance(tier, ReadsArenas) and tier.same_host

    def direct(self, plan: Sequence[int]) -> bool:
        """Whether a load of these planned pages DMAs them from arenas into its device pages
        (CUDA; a CPU pool's load copies them from there itself)."""
        return not self.tier_loads.fills_pool and self.in_arenas(plan)

    def load(self, keys: list[bytes], plan: list[int], pages: np.ndarray, skip: frozenset[str]) -> Loaded:
        """The leading pages that lie in one tier's same-host arenas, DMA'd into `pages` (intact
        after, or not counted); from the first page that did not arrive that way (not in an
        arena, written over, refused), the rest by `TierLoads`' staged path into the pages
        after. Tiers named in `skip` (quarantined by the canary) are not looked in."""
        started = time.perf_counter()
        if self.copier is None:
            self.copier = ArenaCopier(self.pool)
        index = plan[0]
        tier = self.chain.tiers[index]
        assert isinstance(tier, ReadsArenas)
        n = next((i for i, w in enumerate(plan) if w != index), len(plan))
        where = tier.arena_pages(keys[:n])
        lead = next((i for i, ref in enumerate(where) if ref is None), n)
        arrived = self.copier.to_pool(keys[:lead], where[:lead], pages[:lead])
        tier.record_arena_reads(arrived, lead - arrived, arrived * self.tier_loads.spec.bytes_per_page)
        self._observe(tier.name, time.perf_counter() - started, arrived)
        tiers = [tier.name] * arrived
        if arrived < len(keys):
            rest = self.tier_loads.load(keys[arrived:], plan[arrived:], skip=skip)
            try:
                self.tier_loads.staged_to_pool(rest, pages[arrived:arrived + rest.n])
            finally:
                self.tier_loads.give_back(rest)
            arrived += rest.n
            tiers += rest.tiers
        return Loaded(None, arrived, tiers)

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
        if self._register_ahead is not None:
            self._register_ahead.close()
