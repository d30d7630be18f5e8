"""`Sequences`: what an engine does with one sequence's own pages, behind `TieredCache`'s calls.

After `allocate`, a handle's own pages receive the engine's KV (`write`, or `writable_slots`
then `mark_written`); a sequence may fork copy-on-write (forks.py), be preempted by swapping its
pages to host RAM (swaps.py), or drop tokens under a retention policy (compaction.py). Every call
checks the handle first, under the cache's lock; `TieredCache` documents each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiered_cache.cache.arguments import as_count
from tiered_cache.cache.compaction import Compaction
from tiered_cache.cache.demoter import Demoter
from tiered_cache.cache.forks import Forks
from tiered_cache.cache.handle import CacheHandle
from tiered_cache.cache.staging import StagingBuffers
from tiered_cache.cache.swaps import Swaps

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore


class Sequences:
    """Writing, forking, swapping and compacting handles' own pages (see the module doc)."""

    def __init__(self, core: CacheCore, demoter: Demoter, staging: StagingBuffers) -> None:
        self.core = core
        self.ledger, self.pool, self._lock = core.ledger, core.pool, core.lock
        self.forks = Forks(core, demoter)
        self.swaps = Swaps(core, demoter, staging)
        self.compaction = Compaction(core, self.forks)

    def write(self, handle: CacheHandle, kv: torch.Tensor) -> None:
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5:
            raise ValueError(f"write() needs a (layers, 2, tokens, kv_heads, head_dim) tensor, got "
                             f"{getattr(kv, 'shape', type(kv).__name__)}")
        n = int(kv.shape[2])
        self.core.check_kv(kv, n)
        self.pool.write(self.writable_slots(handle, n), kv)  # the handle's own private pages: no lock needed
        handle.own_written += n

    def mark_written(self, handle: CacheHandle, num_tokens: int) -> None:
        num_tokens = as_count("num_tokens", num_tokens)
        with self._lock:
            self._check_writable(handle, num_tokens)
            self.forks.require_private(handle, handle.own_written, handle.own_written + num_tokens)
            handle.own_written += num_tokens

    def fork(self, handle: CacheHandle, n: int) -> list[CacheHandle]:
        n = as_count("fork() needs a positive number of forks: n", n, least=1)
        with self._lock:
            self.ledger.check_live(handle)
            return self.forks.fork(handle, n)

    def writable_slots(self, handle: CacheHandle, num_tokens: int) -> np.ndarray:
        num_tokens = as_count("num_tokens", num_tokens)
        with self._lock:
            self._check_writable(handle, num_tokens)
            self.forks.make_private(handle, handle.own_written, handle.own_written + num_tokens)  # copy-on-write
            slots = self.pool.slots(np.array(handle.own_pages, dtype=np.int64), handle.own_written + num_tokens)
        return slots[handle.own_written:]

    def swap_out(self, handle: CacheHandle) -> int:
        with self._lock:
            self.ledger.check_live(handle)  # refuses one swapped out already
            return self.swaps.swap_out(handle)

    def swap_in(self, handle: CacheHandle, match: Callable[[str, list[bytes], Any], CacheHandle],
                load: Callable[[CacheHandle], np.ndarray], release: Callable[[CacheHandle], None]) -> np.ndarray:
        """With the cache's `match` (on keys), `load` and `release`: the prefix comes back through them."""
        with self._lock:
            self.ledger.check_live(handle, allow_swapped=True)
        return self.swaps.swap_in(handle, match, load, release)

    def live_slots(self, handle: CacheHandle) -> np.ndarray:
        with self._lock:
            self.ledger.check_live(handle)  # refuses a swapped-out handle too
            return self.compaction.live_slots(handle)

    def drop_tokens(self, handle: CacheHandle, live_indices: Any) -> int:
        with self._lock:
            self.ledger.check_live(handle)  # refuses a swapped-out handle too
            return self.compaction.drop(handle, live_indices)

    def _check_writable(self, handle: CacheHandle, n: int) -> None:
        self.ledger.check_live(handle)
        handle.check_room(n)
