"""`SequenceOps`: what an engine does with one sequence's own pages, as `TieredCache` methods.

After `allocate`, a handle's own pages receive the engine's KV (`write`, or `writable_slots`
then `mark_written`); a sequence may fork copy-on-write (forks.py), be preempted by swapping its
pages to host RAM (swaps.py), or drop tokens under a retention policy (compaction.py). The
prefix side of the API (match, load, commit, release) is `TieredCache`'s own; this mixin holds
the rest so the facade reads as its two halves. Every call checks the handle first, under the
cache's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tiered_cache.cache.arguments import as_count
from tiered_cache.cache.compaction import Compaction
from tiered_cache.cache.foreground import request_path
from tiered_cache.cache.forks import Forks
from tiered_cache.cache.handle import CacheHandle
from tiered_cache.cache.ledger import PageLedger
from tiered_cache.cache.swaps import Swaps
from tiered_cache.device.pool import PagePool


class SequenceOps:
    """Writing, forking, swapping and compacting a handle's own pages (see the module doc)."""

    _lock: threading.RLock
    ledger: PageLedger
    pool: PagePool
    forks: Forks
    swaps: Swaps
    compaction: Compaction
    _check_kv: Callable[[Any, int], None]
    _match_keys: Callable[..., CacheHandle]
    load: Callable[[CacheHandle], np.ndarray]
    release: Callable[[CacheHandle], None]

    @request_path
    def write(self, handle: CacheHandle, kv: torch.Tensor) -> None:
        """Write the KV of the handle's next `kv.shape[2]` tokens (tensor-API shape) into its own
        pages, after the tokens already written, and count them as written."""
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5:
            raise ValueError(f"write() needs a (layers, 2, tokens, kv_heads, head_dim) tensor, got "
                             f"{getattr(kv, 'shape', type(kv).__name__)}")
        n = int(kv.shape[2])
        self._check_kv(kv, n)
        self.pool.write(self.writable_slots(handle, n), kv)  # the handle's own private pages: no lock needed
        handle.own_written += n

    @request_path
    def mark_written(self, handle: CacheHandle, num_tokens: int) -> None:
        """Record that the engine wrote the KV of the handle's next `num_tokens` tokens itself
        (into `pool.kv`, at the slots `writable_slots` gave). Only written tokens are ever
        committed. Raises ValueError past the tokens allocated, or over a page a fork shares."""
        num_tokens = as_count("num_tokens", num_tokens)
        with self._lock:
            self._check_writable(handle, num_tokens)
            self.forks.require_private(handle, handle.own_written, handle.own_written + num_tokens)
            handle.own_written += num_tokens

    def fork(self, handle: CacheHandle, n: int) -> list[CacheHandle]:
        """`n` new handles that each continue the sequence `handle` holds: they share its matched
        prefix and its own pages (written or only allocated), and each writes, commits and is
        released on its own. The parent stays live (release it when done). Pages found below the
        device and not loaded yet are not shared: `load()` before forking to share them.
        Raises ValueError for n < 1 or a handle that is not live."""
        n = as_count("fork() needs a positive number of forks: n", n, least=1)
        with self._lock:
            self.ledger.check_live(handle)
            return self.forks.fork(handle, n)

    def writable_slots(self, handle: CacheHandle, num_tokens: int) -> np.ndarray:
        """Flat pool slots for the handle's next `num_tokens` tokens (after those written), for an
        engine that writes K/V into `pool.kv` itself and then calls `mark_written`. Pages there
        that a fork shares are copied first, so the writes reach this sequence alone."""
        num_tokens = as_count("num_tokens", num_tokens)
        with self._lock:
            self._check_writable(handle, num_tokens)
            self.forks.make_private(handle, handle.own_written, handle.own_written + num_tokens)  # copy-on-write
            slots = self.pool.slots(np.array(handle.own_pages, dtype=np.int64), handle.own_written + num_tokens)
        return slots[handle.own_written:]

    def swap_out(self, handle: CacheHandle) -> int:
        """Move the handle's own pages to host RAM and free its device pages; returns the pages
        moved. Raises SwapError (nothing changed) when host RAM cannot hold them."""
        with self._lock:
            self.ledger.check_live(handle)  # refuses one swapped out already
            return self.swaps.swap_out(handle)

    def swap_in(self, handle: CacheHandle) -> np.ndarray:
        """Bring a swapped-out handle back: its prefix matched (and loaded) again, its own pages
        copied into fresh device pages. Returns the handle's own pages. Raises SwapError when
        the prefix is no longer cached anywhere, PoolExhaustedError when the device has no room;
        either way the handle stays swapped out, unchanged."""
        with self._lock:
            self.ledger.check_live(handle, allow_swapped=True)
        return self.swaps.swap_in(handle, self._match_keys, self.load, self.release)

    def live_slots(self, handle: CacheHandle) -> np.ndarray:
        """Flat pool slots of the handle's live tokens in order: its matched prefix, then its own
        written tokens that no policy dropped. What attention reads for this sequence."""
        with self._lock:
            self.ledger.check_live(handle)  # refuses a swapped-out handle too
            return self.compaction.live_slots(handle)

    def drop_tokens(self, handle: CacheHandle, live_indices: Any) -> int:
        """Drop the tokens at `live_indices` (positions in `live_slots(handle)`) from the sequence:
        attention no longer sees them, pages left with no live token are freed, and the handle
        becomes compacted (never committed). Tokens of the matched prefix are shared and cannot be
        dropped (ValueError), nor can tokens not written yet. Returns the pages freed."""
        with self._lock:
            self.ledger.check_live(handle)  # refuses a swapped-out handle too
            return self.compaction.drop(handle, live_indices)

    def _check_writable(self, handle: CacheHandle, n: int) -> None:
        self.ledger.check_live(handle)
        handle.check_room(n)
