"""`BlobStore`: what a store server keeps: a RAM blob tier in front of disk and/or Redis.

The store never decodes pages, so one server serves every model (fingerprints travel in the
blobs). It is a `TierChain` with the RAM tier first: eviction from a tier demotes to the next,
and a hit below RAM is loaded back into RAM. gRPC handlers run on a thread pool; the chain
locks each tier on its own, so a Lookup answered from RAM never waits behind another client's
Get from disk or Redis. Torch-free (the store server never imports torch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tiered_cache.events.schema import MEDIUM_STORAGE
from tiered_cache.server.arena_tier import ArenaTier
from tiered_cache.shm.arena import Ref
from tiered_cache.tiers.base import BlobTier, TierStats
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.ram import ENTRY_OVERHEAD_BYTES, RamTier
from tiered_cache.wire.codec import IDENTITY_BYTES, BlobError, page_identity

_EVENT_BATCH = 4096  # pages per event when the store tells what it holds at start
_GET_ROUNDS = 3  # a key that moved tier between locate and get (an eviction) is looked up again


class BlobStore:
    def __init__(self, ram: RamTier | ArenaTier, lower: Sequence[BlobTier] = (),
                 write_through: bool = False) -> None:
        self.ram = ram
        self.lower = list(lower)
        self.write_through = write_through
        self.chain = TierChain([ram, *self.lower])
        self.replaced = 0  # held blobs a Put replaced with another page identity
        self.events: Any = None  # a CacheEvents while KV events are on (`watch_events`)

    def watch_events(self, events: Any) -> None:
        """Tell `events` (a `CacheEvents`) what the store holds: the pages on disk now, then each
        page a Put stores and each one that leaves the store (evicted from its last tier, deleted,
        replaced), all as the STORAGE medium. Moving between the store's own tiers is no change."""
        self.events = events
        for tier in self.lower:
            held = list(getattr(tier, "index", ()))  # a disk tier's pages survive a restart
            file_of = getattr(tier, "file_of", None)
            for start in range(0, len(held), _EVENT_BATCH):
                batch = held[start:start + _EVENT_BATCH]
                if file_of is None:
                    events.stored(batch, MEDIUM_STORAGE, block_size=0)  # no header to read: size unknown
                else:
                    self._tell_stored([(key, _file_head(file_of(key))) for key in batch])
        self.chain.on_change = lambda keys, held: None if held else events.removed(keys, MEDIUM_STORAGE)

    @property
    def tiers(self) -> list[BlobTier]:
        return self.chain.tiers

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The name of the first tier holding each key, or None."""
        return [None if w is None else self.chain.tiers[w].name for w in self.chain.locate(keys)]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's blob or None; blobs found below RAM are loaded into RAM."""
        out: list[bytes | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(_GET_ROUNDS):
            asked = [keys[i] for i in todo]
            where = self.chain.locate(asked)
            blobs = self.chain.get(asked, where, load=True)
            retry = []
            for i, w, blob in zip(todo, where, blobs, strict=True):
                if blob is not None:
                    out[i] = blob
                elif w is not None:  # located, then gone (evicted or demoted meanwhile): forgotten, ask again
                    retry.append(i)
            if not retry:
                break
            todo = retry
        return out

    def arena_refs(self, keys: Sequence[bytes]) -> tuple[list[Ref | None], list[bytes | None], int]:
        """For a same-host Get: where each key's blob lies in the arena (`ram` is an `ArenaTier`),
        blobs held below loaded into it first; a blob that cannot go in (too large, the arena's
        oldest blob leased) comes back as bytes instead. Returns (refs, blobs, how many refs were
        in the arena already: handed out with no copy at all)."""
        arena = self.ram
        assert isinstance(arena, ArenaTier), "arena_refs needs the RAM tier in shared memory"
        refs = arena.refs(keys, count_misses=False)
        already = sum(ref is not None for ref in refs)
        blobs: list[bytes | None] = [None] * len(keys)
        missing = [i for i, ref in enumerate(refs) if ref is None]
        if missing:
            asked = [keys[i] for i in missing]
            got = self.get(asked)  # from below, loaded into the arena
            for i, ref, blob in zip(missing, arena.refs(asked, count_misses=False), got, strict=True):
                if ref is not None:
                    refs[i] = ref
                else:
                    blobs[i] = blob
        return refs, blobs, already

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> tuple[int, int]:
        """Store verified (key, blob) pairs: (new pages stored, pages already held). Every item is
        one or the other: a key repeated within `items` counts once as stored, then as held.

        The newest Put of a page is the one kept: a key held in RAM whose blob claims another page
        identity (`codec.page_identity`: another model, shape, dtype or length) is replaced, and
        copies of a stored key in the tiers below are dropped (they are written again from RAM). So
        a blob that passed the server's checks but that readers refuse (a page of another model
        under this key) blocks nothing: the reader recomputes the page and its Put replaces it."""
        unique: dict[bytes, bytes] = {}
        for key, blob in items:
            unique.setdefault(key, blob)
        keys = list(unique)
        held = self.chain.contains(keys, 0)
        fresh = []
        for key, was_held in zip(keys, held, strict=True):
            if not was_held:
                fresh.append((key, unique[key]))
            elif self._claims_another_page(key, unique[key]):
                self.delete([key])
                self.replaced += 1
                fresh.append((key, unique[key]))
        for index in range(1, len(self.chain.tiers)):  # the residency this chain knows: no tier's lock
            below = [k for k, _ in fresh if self.chain.known_in(k, index)]
            if below:
                self.chain.delete(below, index)
        if fresh:
            self.chain.put(fresh, 0)  # a blob too big for RAM goes straight to the tier below
            if self.events is not None:
                self._tell_stored(fresh)
        if self.write_through and self.lower and fresh:
            self.chain.put(fresh, 1)
        return len(fresh), len(items) - len(fresh)

    def _tell_stored(self, items: list[tuple[bytes, bytes]]) -> None:
        """One event per run of pages of one size (tokens per page, from each blob's header: the
        blob, or its first IDENTITY_BYTES)."""
        run: list[bytes] = []
        size = -1
        for key, blob in items:
            try:
                tokens = page_identity(blob[:IDENTITY_BYTES])[3]
            except BlobError:
                tokens = 0
            if tokens != size and run:
                self.events.stored(run, MEDIUM_STORAGE, block_size=size)
                run = []
            size = tokens
            run.append(key)
        if run:
            self.events.stored(run, MEDIUM_STORAGE, block_size=size)

    def _claims_another_page(self, key: bytes, blob: bytes) -> bool:
        head = self.ram.head(key, IDENTITY_BYTES)
        if head is None:
            return False  # gone meanwhile: stored as new
        try:
            return page_identity(head) != page_identity(blob)
        except BlobError:
            return True  # what is held is not even a blob header

    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget `keys` in every tier (blobs stored that must not be served)."""
        for index in range(len(self.chain.tiers)):
            self.chain.delete(keys, index)

    def fits(self, size: int) -> bool:
        """Whether a blob of `size` bytes has a tier to go to (RAM, or any tier below it)."""
        ram = self.ram
        largest = ram.max_blob if isinstance(ram, ArenaTier) else ram.capacity - ENTRY_OVERHEAD_BYTES
        return size <= largest or bool(self.lower)

    def flush(self) -> int:
        """Copy every RAM blob that the next tier lacks into it (graceful shutdown); returns how many."""
        if not self.lower:
            return 0
        items = self.chain.items(0)
        below = self.chain.contains([k for k, _ in items], 1)
        todo = [item for item, b in zip(items, below, strict=True) if not b]
        return self.chain.put(todo, 1) if todo else 0

    def stats(self) -> list[TierStats]:
        """Each tier's figures; loads are pages copied up into RAM, demotions pages pushed down
        by an eviction from the tier above. Nothing is above RAM inside the server (the chain counts
        the pages RAM serves as read out of it; its hits say that already)."""
        out = self.chain.stats()
        return [replace(out[0], loads=0), *out[1:]]

    def close(self) -> None:
        """Close tiers that hold connections (Redis clients)."""
        self.chain.close()


def _file_head(path: Any) -> bytes:
    """The first IDENTITY_BYTES of a page file (empty when it cannot be read: size unknown)."""
    try:
        with open(path, "rb") as f:
            return f.read(IDENTITY_BYTES)
    except OSError:
        return b""
