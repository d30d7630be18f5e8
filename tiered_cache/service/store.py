"""`BlobStore`: what a store server keeps: a RAM blob tier in front of disk and/or Redis.

The store never decodes pages, so one server serves every model (fingerprints travel in the
blobs). Eviction from a tier demotes to the next; a hit below RAM is promoted back into RAM.
gRPC handlers run on a thread pool, so every call takes the store's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from tiered_cache.tiers.base import BlobTier, TierStats
from tiered_cache.tiers.memory import MemoryTier


class BlobStore:
    def __init__(self, ram: MemoryTier, lower: Sequence[BlobTier] = (), write_through: bool = False) -> None:
        self.ram = ram
        self.lower = list(lower)
        self.write_through = write_through
        self.lock = threading.RLock()
        self.promotions: dict[str, int] = {}
        self.demotions: dict[str, int] = {}
        self.ram.on_evict = self._demoter(0)
        for i, tier in enumerate(self.lower):
            if hasattr(tier, "on_evict"):
                tier.on_evict = self._demoter(i + 1)

    @property
    def tiers(self) -> list[BlobTier]:
        return [self.ram, *self.lower]

    def _demoter(self, index: int):
        def demote(items: list[tuple[bytes, bytes]]) -> None:
            if index < len(self.lower):
                tier = self.lower[index]
                self.demotions[tier.name] = self.demotions.get(tier.name, 0) + tier.put(items)
        return demote

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The name of the first tier holding each key, or None."""
        with self.lock:
            where: list[str | None] = [None] * len(keys)
            for tier in self.tiers:
                missing = [i for i, w in enumerate(where) if w is None]
                if not missing:
                    break
                for i, held in zip(missing, tier.contains([keys[i] for i in missing]), strict=True):
                    if held:
                        where[i] = tier.name
            return where

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's blob or None; blobs found below RAM are promoted into RAM."""
        with self.lock:
            out = self.ram.get(keys)
            for tier in self.lower:
                missing = [i for i, b in enumerate(out) if b is None]
                if not missing:
                    break
                found = tier.get([keys[i] for i in missing])
                promoted = []
                for i, blob in zip(missing, found, strict=True):
                    if blob is not None:
                        out[i] = blob
                        promoted.append((keys[i], blob))
                if promoted:
                    self.promotions[tier.name] = self.promotions.get(tier.name, 0) + len(promoted)
                    self.ram.put(promoted)
            return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> tuple[int, int]:
        """Store verified (key, blob) pairs: (new pages stored, pages already held)."""
        with self.lock:
            held = self.ram.contains([k for k, _ in items])
            fresh = [item for item, h in zip(items, held, strict=True) if not h]
            stored = self.ram.put(fresh)
            if self.write_through and self.lower and fresh:
                self.lower[0].put(fresh)
            return stored, len(items) - len(fresh)

    def flush(self) -> int:
        """Copy every RAM blob that the next tier lacks into it (graceful shutdown); returns how many."""
        with self.lock:
            if not self.lower:
                return 0
            items = self.ram.items()
            below = self.lower[0].contains([k for k, _ in items])
            todo = [item for item, b in zip(items, below, strict=True) if not b]
            return self.lower[0].put(todo) if todo else 0

    def stats(self) -> list[TierStats]:
        with self.lock:
            out = []
            for tier in self.tiers:
                s = tier.stats()
                s.promotions = self.promotions.get(tier.name, 0)
                s.demotions = self.demotions.get(tier.name, 0)
                out.append(s)
            return out
