"""`TierChain`: blob tiers in order, fastest first, as one store with put / locate / get / demote.
`get_into` writes pages into their destinations (codec.py) instead of returning blobs.

Used below host RAM by `TieredCache` and, with a RAM blob tier in front, by the store server's
`BlobStore`. Torch-free (the store server never imports torch).

- Eviction from tier i demotes its blobs into tier i+1 (through the tiers' `on_evict` hook).
- Residency: the chain remembers, per key, which of its tiers it put the key into or found it in
  (a bounded map). It never re-puts a key a tier is known to hold, and `locate` asks a tier only
  about keys it cannot answer from that map, each tier at most once per call. Knowledge can go
  stale (Redis evicts by itself, a shared store is filled by other instances): a stale "held"
  turns into a miss on get and is forgotten then; a miss never turns into wrong bytes.
- Concurrency: one lock per tier around every call to that tier (none for a tier marked
  `thread_safe`, e.g. Redis and remote clients), taken in tier order (a demotion
  from tier i into tier i+1 holds both), and a small lock for the counters and the residency map.
  No lock spans the whole chain, so a get from Redis never waits behind a disk write.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from tiered_cache.tiers.base import BlobTier, EvictCallback, ReadsInto, TierStats
from tiered_cache.wire.codec import BlobError, PageDest, decode_into

if TYPE_CHECKING:
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.shm.arena_map import ArenaViews

log = logging.getLogger("tiered_cache.tiers.chain")

_DEFAULT_MAX_KNOWN = 1 << 20  # keys whose residency is remembered (~100 B each)


class TierChain:
    def __init__(self, tiers: Sequence[BlobTier], max_known: int = _DEFAULT_MAX_KNOWN) -> None:
        self.tiers: list[BlobTier] = list(tiers)
        self.loads: Counter[str] = Counter()  # blobs read from a tier to be loaded up
        self.demotions: Counter[str] = Counter()  # blobs written into a tier from the one above
        self.skipped_puts = 0  # puts avoided because the tier was known to hold the key
        self.refused: Counter[str] = Counter()  # verified blobs `get_into` found were no page it asked for
        # Called after each batched get from a tier with (tier name, seconds, bytes or pages):
        # metrics and the reuse policy's load-rate estimates both listen (`observe_gets`).
        self._get_observers: list[tuple[Callable[[str, float, int], None], bool]] = []
        # Tiers that are safe to call from several threads (a Redis client pool, gRPC channels)
        # get no lock: a lookup must not queue behind another thread's multi-MiB put.
        self._tier_locks = [contextlib.nullcontext() if getattr(tier, "thread_safe", False) else threading.RLock()
                            for tier in self.tiers]
        self._meta = threading.Lock()
        self._held: OrderedDict[bytes, int] = OrderedDict()  # key -> bit i set: tier i holds it
        self._max_known = max_known
        # Told (keys, held) when a tier is first known to hold keys no tier was known to hold, or
        # when none is known to any more: KV events for the STORAGE medium. Called under a lock.
        self.on_change: Callable[[list[bytes], bool], None] | None = None
        for i, tier in enumerate(self.tiers):
            if hasattr(tier, "on_evict"):
                tier.on_evict = self._demoter(i)

    def __len__(self) -> int:
        return len(self.tiers)

    def observe_gets(self, observer: Callable[[str, float, int], None], pages: bool = False) -> None:
        """Call `observer(tier name, seconds, bytes)` after each batched get from a tier (on the
        getting thread; it must be quick and must not raise): the blobs' bytes as they came, or
        with `pages` the number of pages that arrived (whatever their blobs' sizes: compressed,
        or raw with a header)."""
        self._get_observers.append((observer, pages))

    # --- residency -------------------------------------------------------------------------------
    def known_in(self, key: bytes, index: int) -> bool:
        """Whether tier `index` is known to hold `key` (from this chain's own puts and reads)."""
        with self._meta:
            return bool(self._held.get(key, 0) >> index & 1)

    def known_anywhere(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether any tier of the chain is known to hold it (its own puts and reads):
        a copy above it may be dropped instead of copied down. Knowledge can be stale (a shared
        store evicts by itself): the page then reads as a miss later, never as wrong bytes."""
        with self._meta:
            return [bool(self._held.get(key, 0)) for key in keys]

    def _mark(self, keys: Sequence[bytes], index: int, held: bool, tell: bool = True) -> None:
        bit = 1 << index
        changed: list[bytes] = []  # keys now held somewhere that were not, or no longer held anywhere
        with self._meta:
            for key in keys:
                old = self._held.get(key, 0)
                new = old | bit if held else old & ~bit
                if new:
                    self._held[key] = new
                    self._held.move_to_end(key)
                elif old:
                    del self._held[key]
                if bool(old) != bool(new):
                    changed.append(key)
            while len(self._held) > self._max_known:
                self._held.popitem(last=False)
            if changed and tell and self.on_change is not None:
                self.on_change(changed, held)

    def forget(self, index: int, which: Callable[[bytes], bool] | None = None) -> None:
        """Drop what is known about tier `index` (for the keys `which` picks; all by default): its
        contents changed, e.g. keys moved to other servers behind a remote tier. Later puts of
        those keys go to it again and lookups ask it."""
        bit = 1 << index
        with self._meta:
            known = [k for k, held in self._held.items() if held & bit]
        forgotten = [k for k in known if which is None or which(k)]  # outside the lock: may hash
        self._mark(forgotten, index, held=False)

    # --- interface -------------------------------------------------------------------------------
    def locate(self, keys: Sequence[bytes], leading: bool = False) -> list[int | None]:
        """Index of the first tier holding each key, or None. Known residency answers first; each
        tier is then asked once, about the keys still unanswered. With `leading`, only the
        leading run matters: keys after the first one no tier holds come back None."""
        where: list[int | None] = [None] * len(keys)
        with self._meta:
            for i, key in enumerate(keys):
                bits = self._held.get(key, 0)
                if bits:
                    where[i] = (bits & -bits).bit_length() - 1
        for index, tier in enumerate(self.tiers):
            missing = [i for i, w in enumerate(where) if w is None]
            if not missing:
                break
            with self._tier_locks[index]:
                held = tier.contains([keys[i] for i in missing])
                # Marked under the tier's lock: an eviction after it unmarks, never before it.
                self._mark([keys[i] for i, h in zip(missing, held, strict=True) if h], index, True)
            for i, h in zip(missing, held, strict=True):
                if h:
                    where[i] = index
        if leading:
            first_miss = next((i for i, w in enumerate(where) if w is None), len(where))
            where[first_miss:] = [None] * (len(where) - first_miss)
        return where

    def get(self, keys: Sequence[bytes], where: Sequence[int | None] | None = None,
            load: bool = False, lease: ArenaViews | None = None) -> list[bytes | None]:
        """The verified blob of each key from the tier `where` names (`locate` when not given),
        one batched `get` per tier. A key a tier turned out not to hold is None and forgotten.
        With `load`, blobs found below the first tier are loaded (copied) into it. With `lease` (a
        `ArenaViews`), tiers that can lend pages instead of copying them do (`lends_views`): the
        caller copies them out, then drops those `lease.lost()` names."""
        if lease is not None and load:
            raise ValueError("get cannot load lent pages into the first tier (they are views, good only for a while)")
        where = self.locate(keys) if where is None else where
        out: list[bytes | None] = [None] * len(keys)
        for index, tier in enumerate(self.tiers):
            positions = [i for i, w in enumerate(where) if w == index]
            if not positions:
                continue
            wanted = [keys[i] for i in positions]
            started = time.perf_counter()
            with self._tier_locks[index]:
                lends = lease is not None and getattr(tier, "lends_views", False)
                blobs = tier.get(wanted, lease=lease) if lends else tier.get(wanted)
            self._observe_get(tier.name, started, sum(len(b) for b in blobs if b is not None),
                              sum(1 for b in blobs if b is not None))
            for i, blob in zip(positions, blobs, strict=True):
                out[i] = blob
            self._mark([k for k, b in zip(wanted, blobs, strict=True) if b is None], index, False)
            hits = [(k, b) for k, b in zip(wanted, blobs, strict=True) if b is not None]
            self._count(self.loads, tier.name, len(hits))
            if load and index > 0 and hits:
                self.put(hits, 0)
        return out

    def get_into(self, keys: Sequence[bytes], where: Sequence[int | None], dests: Sequence[PageDest],
                 spec: KVSpec) -> list[bool]:
        """Each key's page of `spec`, verified, decoded into `dests[i]` (a page destination,
        codec.py) from the tier `where` names, one batched call per tier; returns which arrived.
        A tier with `get_into` (which returns each arrived blob's size, 0 for a miss) writes the
        pages into their destinations itself, with no blob in between; other tiers' blobs are
        decoded here. A key a tier turned out not to hold is
        forgotten; a blob refused (corrupt, or not a page of `spec`) is a miss, counted in that
        tier's `corrupt` and deleted there. A destination whose page did not arrive holds anything."""
        arrived = [False] * len(keys)
        for index, tier in enumerate(self.tiers):
            positions = [i for i, w in enumerate(where) if w == index]
            if not positions:
                continue
            wanted, targets = [keys[i] for i in positions], [dests[i] for i in positions]
            started = time.perf_counter()
            if isinstance(tier, ReadsInto):
                with self._tier_locks[index]:
                    got = tier.get_into(wanted, targets, spec)
            else:
                got = self._decoded_into(index, wanted, targets, spec)
            self._observe_get(tier.name, started, sum(got), sum(1 for size in got if size))  # blob bytes, as in `get`
            for i, size in zip(positions, got, strict=True):
                arrived[i] = size > 0
            self._mark([k for k, size in zip(wanted, got, strict=True) if not size], index, False)
            self._count(self.loads, tier.name, sum(1 for size in got if size))
        return arrived

    def _observe_get(self, tier: str, started: float, nbytes: int, pages: int) -> None:
        """Tell the get observers that a batched get from `tier` begun at `started` read `pages`
        pages in `nbytes` bytes of blobs."""
        seconds = time.perf_counter() - started
        for observe, in_pages in self._get_observers:
            observe(tier, seconds, pages if in_pages else nbytes)

    def _decoded_into(self, index: int, keys: list[bytes], dests: list[PageDest], spec: KVSpec) -> list[int]:
        """`get_into` for a tier without its own `get_into`: its verified blobs, decoded here (outside
        its lock). A blob that is no page of `spec` is refused: counted and deleted."""
        with self._tier_locks[index]:
            blobs = self.tiers[index].get(keys)
        got = [0] * len(keys)
        refused = []
        for i, (key, blob, dest) in enumerate(zip(keys, blobs, dests, strict=True)):
            if blob is None:
                continue
            try:
                # NOTE: a BlobTier verifies the checksum of every blob it returns (base.py).
                decode_into(blob, spec, key, dest, check_crc=False)
                got[i] = len(blob)
            except BlobError:
                refused.append(key)
        if refused:
            self._count(self.refused, self.tiers[index].name, len(refused))
            self.delete(refused, index)
        return got

    def put(self, items: Sequence[tuple[bytes, bytes]], index: int = 0, demotion: bool = False) -> int:
        """Store (key, blob) pairs in tier `index`, skipping keys it is known to hold. Returns how
        many the tier reports stored. With `demotion` (pages an eviction above pushed down) each
        page that this tier now holds counts as demoted into it, stored now or held already: the
        tier above's evictions and this tier's demotions then agree on what moved where."""
        if not self.tiers:
            return 0
        todo = [(k, b) for k, b in items if not self.known_in(k, index)]
        skipped = len(items) - len(todo)
        if skipped:
            with self._meta:
                self.skipped_puts += skipped
            if demotion:
                self._count(self.demotions, self.tiers[index].name, skipped)
        if not todo:
            return 0
        keys = [k for k, _ in todo]
        with self._tier_locks[index]:
            # Marked before the put, under the tier's lock: a key the put itself evicts (a batch
            # larger than the tier, a blob too big for it) is unmarked by the demoter afterwards.
            self._mark(keys, index, True)
            stored = self.tiers[index].put(todo)
            if not stored:  # nothing stored (a tier that is down, blobs too big): claim nothing
                self._mark(keys, index, False)
        if stored and demotion:
            self._count(self.demotions, self.tiers[index].name, stored)
        return stored

    def delete(self, keys: Sequence[bytes], index: int) -> None:
        """Forget `keys` in tier `index` (a blob that failed to decode there)."""
        with self._tier_locks[index]:
            self.tiers[index].delete(keys)
        self._mark(keys, index, False)

    def contains(self, keys: Sequence[bytes], index: int) -> list[bool]:
        """Ask tier `index` itself (not the residency map), and remember its answer."""
        with self._tier_locks[index]:
            held = self.tiers[index].contains(keys)
            self._mark([k for k, h in zip(keys, held, strict=True) if h], index, True)
            self._mark([k for k, h in zip(keys, held, strict=True) if not h], index, False)
        return held

    def items(self, index: int) -> list[tuple[bytes, bytes]]:
        """Every (key, blob) tier `index` holds, for a tier that lists them (`RamTier.items`)."""
        with self._tier_locks[index]:
            return list(self.tiers[index].items())

    def stats(self) -> list[TierStats]:
        """Each tier's own figures with the chain's loads and demotions filled in. Takes no
        tier lock: figures are counters a tier may report while a call is under way, and a stats
        call must never wait behind data."""
        out = []
        for tier in self.tiers:
            own = tier.stats()
            with self._meta:
                out.append(replace(own, loads=self.loads[tier.name],
                                   demotions=self.demotions[tier.name],
                                   corrupt=own.corrupt + self.refused[tier.name]))
        return out

    def warm(self) -> None:
        """Open what tiers open on first use (connections, arena maps, reader threads), for tiers
        that have `warm`; one that fails is logged and left to open on first use."""
        for tier in self.tiers:
            warm = getattr(tier, "warm", None)
            if warm is None:
                continue
            try:
                warm()
            except Exception as exc:
                log.info("warming up tier %s failed (%s: %s)", tier.name, type(exc).__name__, exc)

    def close(self) -> None:
        """Close tiers that hold connections or threads (Redis clients, gRPC channels)."""
        for tier in self.tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()

    # --- demotion --------------------------------------------------------------------------------
    def _demoter(self, index: int) -> EvictCallback:
        """Tier `index` is dropping these blobs: forget them there and put them one tier down.
        Runs inside that tier's call, so its lock is held; the next tier's lock is taken after it."""
        def demote(items: list[tuple[bytes, bytes]]) -> None:
            keys = [k for k, _ in items]
            below = index + 1 < len(self.tiers)
            self._mark(keys, index, False, tell=not below)  # moving down is no removal: told after the put
            if below:
                self.put(items, index + 1, demotion=True)
                if self.on_change is not None:
                    with self._meta:
                        gone = [k for k in keys if not self._held.get(k)]
                    if gone:
                        self.on_change(gone, False)
        return demote

    def _count(self, counter: Counter[str], name: str, n: int) -> None:
        if n:
            with self._meta:
                counter[name] += n
