"""`ArenaTier`: the same-host arena (shm/arena.py) as the store server's RAM tier.

The arena itself is shared memory and knows nothing of tiers; this adapter names it "ram" and
reports its figures as a `TierStats`, so a `BlobStore` keeps it in its `TierChain` like any other
blob tier (a `RamTier` takes its place with `serve --shm off`). Only the server keeps it.
"""

from __future__ import annotations

from tiered_cache.shm.arena import Arena
from tiered_cache.tiers.base import Tier, TierStats


class ArenaTier(Arena):
    """The arena as the store's RAM tier (a `BlobTier` named "ram")."""

    name = Tier.RAM.value

    def stats(self) -> TierStats:
        counts = self.arena_stats()
        return TierStats(self.name, capacity_bytes=self.capacity, used_bytes=counts.used, pages=counts.pages,
                         hits=counts.hits, misses=counts.misses, evictions=counts.evictions,
                         bytes_in=counts.bytes_in, bytes_out=counts.bytes_out)
