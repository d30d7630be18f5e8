"""Exceptions a caller can act on. Each message says what was expected and what was found."""

from __future__ import annotations


class TieredCacheError(Exception):
    """Base class of every error tiered-cache raises on purpose."""


class PoolExhaustedError(TieredCacheError):
    """Not enough free pages. Nothing was allocated; evict `needed - available` pages and retry."""

    def __init__(self, needed: int, available: int, total: int) -> None:
        self.needed = needed
        self.available = available
        self.total = total
        super().__init__(
            f"page pool exhausted: asked for {needed} pages, {available} of {total} free "
            f"(evict at least {needed - available} pages and retry)"
        )


class PageStateError(TieredCacheError, ValueError):
    """Pages given to the pool are out of range, repeated, already free, or not allocated."""


class StaleHandleError(TieredCacheError, ValueError):
    """A radix-tree handle names a node that was evicted: its values may now hold other tokens.
    Match the prefix again to get a live handle."""


class KVShapeError(TieredCacheError, ValueError):
    """A KV tensor's shape, dtype or device does not match the spec it is used with."""


class IntegrityError(TieredCacheError, AssertionError):
    """An internal invariant is broken (raised by `check_integrity()`): a bug, never user error."""


class SwapError(TieredCacheError):
    """A request could not be swapped out or in (host RAM full, its prefix no longer cached, no
    room on the device). Nothing changed: the request is where it was; drop and recompute it, or
    retry when room is made."""
