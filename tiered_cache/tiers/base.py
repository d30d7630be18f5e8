"""What every tier shares: its figures, and the interface of tiers that hold blobs (DESIGN.md §7).

`BlobTier` is what every blob tier offers. A tier may offer more; callers test for each
capability with `isinstance` against its protocol here, never by looking for a method name:
`ReadsInto` (pages straight into their destinations), `ReadsArenas` (pages read in place in
same-host store servers' arenas), `Readdressable` (its servers change at run time). Flags a tier
may set as class attributes: `thread_safe` (callable from several threads at once: `TierChain`
gives it no lock), `lends_views` (`get(lease=)` hands out views of memory it keeps), and
`on_evict` (an `EvictCallback` attribute `TierChain` sets to demote what it drops further
down). `close()` and `warm()`, where a tier has them, release and open its connections."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.shm.arena_map import ArenaRef
    from tiered_cache.wire.codec import PageDest

class Tier(str, enum.Enum):
    """Every tier a page can be in: the one word for each, which its figures, metrics labels and
    `CacheConfig.lower_tiers` carry (a tier's `name` is its member's value). A handle's plan names
    where a page is by position instead: HOST, or the index of a lower tier in the cache's chain."""

    DEVICE = "device"  # the page pool the engine's attention reads (GPU memory, or CPU)
    HOST = "host"  # host RAM beside the pool: pages as they are, no codec
    DISK = "disk"
    REDIS = "redis"
    REMOTE = "remote"  # one or more store servers (`tiered-cache serve`)
    RAM = "ram"  # a RAM blob tier: a store server's front tier, the vLLM connector's

    def __str__(self) -> str:
        return self.value

    @classmethod
    def lower(cls) -> tuple[Tier, ...]:
        """The tiers a cache can name below host RAM (`CacheConfig.lower_tiers`)."""
        return (cls.DISK, cls.REDIS, cls.REMOTE)


# Called with (key, blob) pairs a tier is about to drop, so the cache can demote them further down.
EvictCallback = Callable[[list[tuple[bytes, bytes]]], None]


@dataclass
class TierStats:
    """Figures of one tier. Counters only grow; capacity, used bytes and pages are current."""

    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    pages: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    loads: int = 0  # pages read from this tier to be loaded up
    demotions: int = 0  # pages written into this tier from the one above
    bytes_in: int = 0
    bytes_out: int = 0
    errors: int = 0  # failed calls (a tier that is down, a timeout)
    corrupt: int = 0  # blobs refused on read (checksum, truncation, wrong key) and deleted
    breaker_trips: int = 0  # times a server's circuit breaker opened (remote and Redis tiers)
    open_breakers: int = 0  # servers whose breaker is open or half-open now
    breakers: dict[str, str] = field(default_factory=dict)  # server -> closed / open / half-open

    def record_reads(self, blobs: Iterable[bytes | None]) -> None:
        """Count each blob returned as a hit (and its bytes out), each None as a miss."""
        for blob in blobs:
            if blob is None:
                self.misses += 1
            else:
                self.hits += 1
                self.bytes_out += len(blob)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class BlobTier(Protocol):
    """A tier below host RAM: stores page blobs (codec.py) by page key. All calls are batched,
    never raise for a tier that is down or slow (they report misses and count errors), and
    never return a blob that fails `codec.verify_blob` for the key asked (module doc: what a
    tier may offer besides)."""

    name: str

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether this tier holds each key (one batched call)."""

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` this tier holds."""

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The verified blob of each key, or None for a miss."""

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store (key, blob) pairs; returns how many were stored."""

    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget these keys (missing ones are ignored)."""

    def stats(self) -> TierStats:
        """Current figures."""


@runtime_checkable
class ReadsInto(Protocol):
    """A tier that reads pages straight into their destinations (disk, Redis, remote):
    `TierChain.get_into` uses it, and decodes `get`'s blobs for tiers without it."""

    def get_into(self, keys: Sequence[bytes], dests: Sequence[PageDest], spec: KVSpec) -> list[int]:
        """Each key's page of `spec`, verified, written into its destination (codec.py: a staging
        row, or a CPU pool's page): the stored blob's size for each that arrived, 0 for a miss. A
        refused blob is counted as corrupt and deleted where the tier can."""


@runtime_checkable
class ReadsArenas(Protocol):
    """A tier whose pages may lie in the arenas of store servers on this host (shm/arena.py),
    which a load reads in place (`cache/arena_loads.py`) instead of asking for them."""

    @property
    def same_host(self) -> bool:
        """Whether its servers run on this host, their arenas mapped here: pages can be read in place."""

    def arena_pages(self, keys: Sequence[bytes]) -> list[ArenaRef | None]:
        """Where each key's blob lies in a same-host arena, or None. Nothing is copied or verified:
        the caller copies each page from where it lies, checks it, and asks `ArenaMap.intact` after."""

    def record_arena_reads(self, arrived: int, missed: int, nbytes: int) -> None:
        """Count pages a caller read from arenas itself, as this tier's hits and misses."""


@runtime_checkable
class Readdressable(Protocol):
    """A tier whose servers can change at run time (a cluster's shard directory changed)."""

    @property
    def addresses(self) -> list[str]:
        """The servers reached now."""

    def set_addresses(self, addresses: Sequence[str]) -> bool:
        """Reach `addresses` from now on; returns whether anything changed."""


def leading_run(flags: Iterable[bool]) -> int:
    """How many leading entries of `flags` are true (stops at the first false one)."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
