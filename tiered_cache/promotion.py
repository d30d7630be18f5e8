"""`Promoter`: brings a matched prefix's pages from below the device up into device pages.

The load (promotion) path of `TieredCache`, in one place:

- `plan`: where each page past the device prefix lives (host RAM, or which lower tier), asking
  each lower tier at most once.
- `prefetch`: start a `fetch` in the background (bounded: `max_prefetches` in flight, the rest
  declined and counted, `load` then fetches inline).
- `fetch`: copy the pages into a leased page-first staging buffer: host RAM pages under the
  cache's lock (memory), lower-tier blobs fetched (one batched call per tier) and decoded
  outside it; a page that moved meanwhile is looked for again, a bounded number of times.
- `host_to_pool`: host RAM slots straight into device pages, one DMA per run of slots on CUDA
  (`device/host_copy.py`), with no staging copy.

Who owns what: the cache allocates device pages and hands them to the tree (it owns the
ledger); the promoter only fills pages it is given and staging buffers it leased.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiered_cache.cache_stats import Movements
from tiered_cache.config import CacheConfig
from tiered_cache.device.host_copy import HostCopier
from tiered_cache.device.pool import PagePool
from tiered_cache.handle import HOST, Prefetch
from tiered_cache.model.spec import KVSpec
from tiered_cache.staging import StagingBuffers
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.codec import BlobError, decode_page
from tiered_cache.tiers.host import HostTier

_NOWHERE = -2  # in a plan being built: no tier found the page (HOST is -1, lower tiers >= 0)
_MAX_REPLANS = 3  # times one fetch looks again for pages that moved down while it ran

# Called after each load of pages into the pool from a tier with (tier name, bytes, seconds).
LoadObserver = Callable[[str, int, float], None]


@dataclass
class Fetched:
    """Pages brought up from below into a leased staging buffer: the first `n` are valid."""

    buffer: torch.Tensor
    n: int
    tiers: list[str]  # the tier that supplied each of the n pages


class Promoter:
    """The promotion path of one `TieredCache` (see the module doc)."""

    def __init__(self, spec: KVSpec, pool: PagePool, host: HostTier, chain: TierChain, lock: threading.RLock,
                 in_flight: MutableMapping[bytes, torch.Tensor], moves: Movements, config: CacheConfig) -> None:
        self.spec = spec
        self.pool = pool
        self.host = host
        self.chain = chain
        self.moves = moves
        self.staging = StagingBuffers(spec, pin=pool.kv.device.type == "cuda")
        self.copier = HostCopier(pool)
        self.declined = 0  # prefetches not started because max_prefetches were in flight
        self.on_load: LoadObserver | None = None
        self._lock = lock  # the cache's: guards host RAM metadata and `in_flight`
        self._in_flight = in_flight  # pages on their way below, still served from memory
        self._workers = config.prefetch_workers
        self._slots = threading.BoundedSemaphore(config.max_prefetches)
        self._executor: ThreadPoolExecutor | None = None

    # --- where the pages are ------------------------------------------------------------------
    def plan(self, keys: Sequence[bytes], in_host: Sequence[bool]) -> list[int]:
        """Where each page of the leading run of `keys` found below the device lives: HOST, or
        the index of the lower tier to fetch it from. Each lower tier is asked at most once."""
        plan: list[int] = [HOST if held else _NOWHERE for held in in_host]
        ask = [i for i, p in enumerate(plan) if p == _NOWHERE]
        if ask and self.chain.tiers:
            where = self.chain.locate([keys[i] for i in ask])
            for i, w in zip(ask, where, strict=True):
                if w is not None:
                    plan[i] = w
        first_miss = next((i for i, p in enumerate(plan) if p == _NOWHERE), len(plan))
        return plan[:first_miss]

    # --- moving them up -------------------------------------------------------------------------
    def host_to_pool(self, slots: np.ndarray, pages: np.ndarray) -> None:
        """Copy host RAM `slots` into device `pages` (caller holds the cache's lock, so the slots
        stay put): one DMA per run of slots on CUDA, one strided copy per run on the CPU."""
        started = time.perf_counter()
        self.copier.to_pool(self.host.slab, slots, pages)
        self._observe("host", len(pages), time.perf_counter() - started)

    def staged_to_pool(self, fetched: Fetched, pages: np.ndarray) -> None:
        """Copy the first `len(pages)` fetched pages from their staging buffer into device `pages`."""
        self.copier.to_pool(fetched.buffer, np.arange(len(pages), dtype=np.int64), pages)

    def prefetch(self, keys: list[bytes], plan: list[int]) -> Prefetch | None:
        """Start fetching `keys` (located by `plan`) in the background; None when `max_prefetches`
        are already in flight (counted in `declined`)."""
        if not self._slots.acquire(blocking=False):
            self.declined += 1
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="tiered-cache-prefetch")
        cancel = threading.Event()

        def job() -> Fetched:
            try:
                return self.fetch(keys, plan, cancel)
            finally:
                self._slots.release()

        return Prefetch(self._executor.submit(job), cancel)

    def fetch(self, keys: list[bytes], plan: list[int], cancel: threading.Event | None = None) -> Fetched:
        """Copy the leading pages of `keys` into a leased staging buffer, page-first: host RAM
        pages under the lock (memory), lower-tier blobs fetched (one batched call per tier) and
        decoded outside it. A page that left host RAM since `match` (demoted meanwhile) is looked
        for below once; the fetch stops at the first page that no longer arrives intact."""
        started = time.perf_counter()
        buffer = self.staging.lease(len(keys))
        raw = buffer.view(torch.uint8).reshape(buffer.shape[0], -1).numpy()
        plan = list(plan)
        blobs = self._fetch_blobs(keys, plan, 0)
        tiers: list[str] = []
        pos, replans = 0, 0
        while pos < len(keys) and not (cancel is not None and cancel.is_set()):
            if plan[pos] == HOST:
                end = pos
                while end < len(keys) and plan[end] == HOST:
                    end += 1
                with self._lock:
                    n = self._copy_from_host(keys[pos:end], buffer[pos:end])
                tiers += ["host"] * n
                pos += n
                arrived = pos == end
            else:
                index = plan[pos]
                arrived = self._decode_into(index, keys[pos], blobs.get(pos), raw[pos])
                if arrived:
                    tiers.append(self.chain.tiers[index].name)
                    pos += 1
            if not arrived:
                # The page moved since `match` (background demotion goes on while we read): look
                # for the rest below again, a bounded number of times; then the prefix ends here.
                if replans == _MAX_REPLANS or not self.chain.tiers:
                    break
                replans += 1
                where = self.chain.locate(keys[pos:], leading=True)
                cut = next((i for i, w in enumerate(where) if w is None), len(where))
                keys, plan = keys[:pos + cut], plan[:pos] + [w for w in where[:cut] if w is not None]
                blobs.update(self._fetch_blobs(keys, plan, pos))
        if tiers and len(set(tiers)) == 1:  # a rate per tier: mixed fetches tell none
            self._observe(tiers[0], len(tiers), time.perf_counter() - started)
        return Fetched(buffer, pos, tiers)

    def give_back(self, fetched: Fetched) -> None:
        """The staging buffer of a fetch whose pages are in place (or dropped)."""
        self.staging.give_back(fetched.buffer)

    def give_back_when_done(self, future: Future[Any]) -> None:
        """A prefetch nobody will load: its buffer returns once it ends."""
        def done(f: Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.give_back(f.result())

        future.add_done_callback(done)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    # --- internals ------------------------------------------------------------------------------
    def _fetch_blobs(self, keys: list[bytes], plan: list[int], start: int) -> dict[int, bytes | None]:
        """Blobs of the planned lower-tier pages at positions >= `start` (one call per tier)."""
        below = [i for i in range(start, len(keys)) if plan[i] != HOST]
        if not below:
            return {}
        got = self.chain.fetch([keys[i] for i in below], [plan[i] for i in below])
        return dict(zip(below, got, strict=True))

    def _copy_from_host(self, keys: list[bytes], out: torch.Tensor) -> int:
        """Copy the leading run of `keys` held in host RAM or queued for below into `out` (lock held)."""
        n = 0
        while n < len(keys):
            if keys[n] in self._in_flight:
                out[n].copy_(self._in_flight[keys[n]])
                n += 1
                continue
            run, _ = self.host.get(keys[n:], out=out[n:])
            if not run:
                break
            n += run
        return n

    def _decode_into(self, index: int, key: bytes, blob: bytes | None, out: np.ndarray) -> bool:
        """Decode `blob` into `out` (one page's bytes); a bad blob is counted, deleted, and False."""
        if blob is None:
            return False
        try:
            # NOTE: a BlobTier verifies the checksum of every blob it returns (DESIGN.md §7).
            decode_page(blob, self.spec, key, out=out, check_crc=False)
        except BlobError:
            with self._lock:
                self.moves.refused[self.chain.tiers[index].name] += 1
            self.chain.delete([key], index)
            return False
        return True

    def _observe(self, tier: str, num_pages: int, seconds: float) -> None:
        if self.on_load is not None and num_pages:
            self.on_load(tier, num_pages * self.spec.bytes_per_page, seconds)
