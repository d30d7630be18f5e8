"""RAM blob tier: blobs as bytes in process memory, LRU within a byte capacity.

The RAM tier in front of the lower tiers where pages stay blobs: the store server's with
`--shm off` (it never decodes pages: it serves any model; else its arena, server/arena_tier.py)
and the vLLM connector's block store. Blobs are verified when they enter (`put` callers check
them); memory that never leaves the process is not checksummed again on every read.

Capacity counts what an entry really costs the process, not only its payload: each entry also
holds a key object, a bytes header and an ordered-dict slot, and a tier that keeps evicting leaves
the allocator's free lists behind (about 560 bytes an entry in resident memory, CPython 3.11, under
a flood of the smallest pages), so a tier of tiny blobs stays within its bound too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tiered_cache.model.units import parse_size
from tiered_cache.tiers.base import EvictCallback, Tier, TierStats, leading_run

# Charged per entry beside its blob: objects (key 65, bytes header 33, ordered-dict slot ~126) and
# what churn leaves unreturned; resident memory stays within 1.5x of the capacity (test_store_memory.py).
ENTRY_OVERHEAD_BYTES = 512


def entry_cost(blob: bytes) -> int:
    """Bytes of process memory one entry holding `blob` takes."""
    return len(blob) + ENTRY_OVERHEAD_BYTES


class RamTier:
    name = Tier.RAM.value

    def __init__(self, capacity: int | str, on_evict: EvictCallback | None = None) -> None:
        self.capacity = parse_size(capacity)
        self.on_evict = on_evict
        self.index: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self.used = 0
        self._stats = TierStats(self.name, capacity_bytes=self.capacity)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self.index for key in keys]

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return leading_run(key in self.index for key in keys)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out = [self.index.get(key) for key in keys]
        for key, blob in zip(keys, out, strict=True):
            if blob is not None:
                self.index.move_to_end(key)
        self._stats.record_reads(out)
        return out

    def head(self, key: bytes, n: int) -> bytes | None:
        """The first `n` bytes of `key`'s blob, or None; not a read (no figures, no LRU move)."""
        blob = self.index.get(key)
        return None if blob is None else bytes(blob[:n])

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        stored = 0
        for key, blob in items:
            if key in self.index:
                self.index.move_to_end(key)
                continue
            if type(blob) is not bytes:  # a view into a received message would hold all of it
                blob = bytes(blob)
            cost = entry_cost(blob)
            if cost > self.capacity:
                if self.on_evict:
                    self.on_evict([(key, blob)])  # too big for RAM: straight down
                continue
            self._evict_to(self.capacity - cost)
            self.index[key] = blob
            self.used += cost
            self._stats.bytes_in += len(blob)
            stored += 1
        return stored

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            blob = self.index.pop(key, None)
            if blob is not None:
                self.used -= entry_cost(blob)

    def items(self) -> list[tuple[bytes, bytes]]:
        """Everything held, least recently used first (for a flush at shutdown)."""
        return list(self.index.items())

    def stats(self) -> TierStats:
        self._stats.pages = len(self.index)
        self._stats.used_bytes = self.used
        return self._stats

    def _evict_to(self, limit: int) -> None:
        victims = []
        while self.used > limit and self.index:
            key, blob = self.index.popitem(last=False)
            self.used -= entry_cost(blob)
            victims.append((key, blob))
        if victims:
            self._stats.evictions += len(victims)
            if self.on_evict:
                self.on_evict(victims)
