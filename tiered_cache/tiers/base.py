"""What every tier shares: its figures, and the interface of tiers that hold blobs (DESIGN.md §7)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

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
    promotions: int = 0  # pages read from this tier to be copied up
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
    never return a blob that fails `codec.verify_blob` for the key asked.

    A tier may also offer `get_into(keys, dests, spec) -> list[int]`: each key's page of `spec`,
    verified, written straight into its destination (codec.py: a staging row, or a CPU pool's
    page), with the stored blob's size for each that arrived and 0 for a miss; a refused blob is
    counted as corrupt and deleted where the tier can. `TierChain.fetch_into` uses it where it
    exists (disk, Redis, remote) and decodes `get`'s blobs otherwise."""

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


def leading_run(flags: Iterable[bool]) -> int:
    """How many leading entries of `flags` are true (stops at the first false one)."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
