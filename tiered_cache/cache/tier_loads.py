"""`TierLoads`: loads a matched prefix's pages from host RAM and the tiers below into memory the
pool reads.

The stages of a load, top-down (`loader.py` drives them):

- `plan`: where each page past the device prefix lives (host RAM, or which lower tier), asking
  each lower tier at most once; the reuse policy then cuts it where loading stops paying
  (`reuse.py`).
- Pages all in host RAM go straight from their rows into device pages (`host_loads.py`); pages in
  a same-host store server's arena are DMA'd from there on CUDA (`arena_loads.py`).
- `load` (here) loads the rest: on a CPU pool, when none is in host RAM, into the device pages
  the cache allocated for them (`fills_pool`: the tier's read is placed in the page), else into
  a leased page-first staging buffer, pinned on CUDA (a prefetch, whose pages are not allocated
  yet; host RAM pages, copied out before an allocation could evict them), then one copy or DMA
  into the pool (`staged_to_pool`). Host RAM pages are copied under the cache's lock (memory);
  lower-tier pages go straight from the tier into their destinations outside it
  (`TierChain.get_into`: no blob in between, each page verified where it is placed). A page that
  moved meanwhile is looked for again, a bounded number of times.
- `prefetch`: a `load` in the background (bounded: `max_prefetches` in flight, the rest declined
  and counted; `TieredCache.load` then loads inline). On a CPU pool with no page in host RAM it
  fills device pages allocated for it, which `load` adopts: a prefetched load copies nothing more
  than a direct one.

Nothing is put into host RAM on the way up. Who owns what: the cache allocates device pages and
hands them to the tree (it owns the ledger); `TierLoads` only fills pages it is given and staging
buffers it leased.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tiered_cache.cache.handle import HOST, Prefetch
from tiered_cache.cache.staging import StagingBuffers
from tiered_cache.tiers.base import Tier
from tiered_cache.wire.codec import PageDest

if TYPE_CHECKING:
    from tiered_cache.cache.core import CacheCore

_NOWHERE = -2  # in a plan being built: no tier found the page (HOST is -1, lower tiers >= 0)
_MAX_REPLANS = 3  # times one load looks again for pages that moved down while it ran
_WARM_STAGING_BYTES = 1 << 30  # pinned staging made at start (CUDA): a larger load pins more then


@dataclass
class Loaded:
    """Pages loaded from below, the first `n` valid: in a leased staging `buffer`, or (None)
    straight in the device pages the load was given."""

    buffer: torch.Tensor | None
    n: int
    tiers: list[str]  # the tier that supplied each of the n pages


class TierLoads:
    """The loads from below the device of one `TieredCache` (see the module doc)."""

    def __init__(self, core: CacheCore) -> None:
        self.spec, self.pool = spec, pool = core.spec, core.pool
        self.host, self.chain, self.copier = core.host, core.chain, core.copier
        self.staging = StagingBuffers(spec, pin=pool.kv.device.type == "cuda")
        # On a CPU pool, pages from below are placed straight in their device pages: the pool is memory
        # too, and staging would be a second pass over every byte. Its bytes as
        # (K/V, layer, page, bytes): one page's blocks, in page-first order, are `_pool_dest`.
        self.fills_pool = pool.kv.device.type == "cpu"
        self._pool_bytes: np.ndarray | None = None
        if self.fills_pool:
            with torch.inference_mode(False):
                self._pool_bytes = pool.kv.view(torch.uint8).reshape(2, spec.num_layers, pool.num_pages, -1).numpy()
        self.declined = 0  # prefetches not started because max_prefetches were in flight
        self._observe = core.reuse.observe  # (tier, seconds, pages) of a whole load from one tier
        self._lock = core.lock  # guards host RAM metadata and `in_flight`
        self._in_flight = core.in_flight  # pages on their way below, still served from memory
        self._workers = core.config.prefetch_workers
        self._prefetch_permits = threading.BoundedSemaphore(core.config.max_prefetches)
        self._executor: ThreadPoolExecutor | None = None
        self._start_lock = threading.Lock()

    # --- where the pages are ------------------------------------------------------------------
    def plan(self, keys: Sequence[bytes], in_host: Sequence[bool], skip: frozenset[str] = frozenset()) -> list[int]:
        """Where each page of the leading run of `keys` found below the device lives: HOST, or
        the index of the lower tier to load it from. Each lower tier is asked at most once.
        Tiers named in `skip` (quarantined by the canary) count as not holding anything."""
        plan: list[int] = [HOST if held and self.host.name not in skip else _NOWHERE for held in in_host]
        ask = [i for i, p in enumerate(plan) if p == _NOWHERE]
        if ask and self.chain.tiers:
            where = self.chain.locate([keys[i] for i in ask])
            for i, w in zip(ask, where, strict=True):
                if w is not None and self.chain.tiers[w].name not in skip:
                    plan[i] = w
        first_miss = next((i for i, p in enumerate(plan) if p == _NOWHERE), len(plan))
        return plan[:first_miss]

    def staged_to_pool(self, loaded: Loaded, pages: np.ndarray) -> None:
        """Copy the first `len(pages)` loaded pages from their staging buffer into device `pages`."""
        self.copier.to_pool(loaded.buffer, np.arange(len(pages), dtype=np.int64), pages)

    def prefetch(self, keys: list[bytes], plan: list[int], skip: frozenset[str] = frozenset(),
                 pages: Callable[[], np.ndarray] | None = None) -> Prefetch | None:
        """Start loading `keys` (located by `plan`) in the background: into staging, or into the
        device pages `pages()` allocates (a CPU pool, no page in host RAM: `load`'s direct way, so
        the load that takes it copies nothing); None when `max_prefetches` are already in flight
        (counted in `declined`)."""
        if not self._prefetch_permits.acquire(blocking=False):
            self.declined += 1
            return None
        into = None
        if pages is not None:
            try:
                into = pages()
            except BaseException:
                self._prefetch_permits.release()
                raise
            keys, plan = keys[:len(into)], plan[:len(into)]
        with self._start_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="tiered-cache-prefetch")
        cancel = threading.Event()

        def job() -> Loaded:
            try:
                return self.load(keys, plan, cancel, pages=into, skip=skip)
            finally:
                self._prefetch_permits.release()

        return Prefetch(self._executor.submit(job), cancel, into)

    def load(self, keys: list[bytes], plan: list[int], cancel: threading.Event | None = None,
             pages: np.ndarray | None = None, skip: frozenset[str] = frozenset()) -> Loaded:
        """Load the leading pages of `keys` (located by `plan`), page-first: into device
        `pages` (one per key; the caller owns them until it adopts them) when given, for a plan
        with no page in host RAM on a CPU pool (`fills_pool`), else into a leased staging buffer. Host RAM
        pages are copied under the lock (memory), lower-tier pages go straight into their
        destinations outside it (one batched call per tier, each page verified where it is placed).
        A page that left host RAM since `match` (demoted meanwhile) is looked for below again;
        the load stops at the first page that no longer arrives intact. Tiers named in `skip`
        (quarantined by the canary) are not looked in then either, as in `plan`."""
        started = time.perf_counter()
        buffer: torch.Tensor | None = None
        if pages is not None:
            assert self.fills_pool and len(pages) >= len(keys) and HOST not in plan, \
                "load into device pages: a CPU pool, one page per key, none from host RAM"
            dests: list[PageDest] = [self._pool_dest(int(page)) for page in pages[:len(keys)]]
        else:
            buffer = self.staging.lease(len(keys))
            raw = buffer.view(torch.uint8).reshape(buffer.shape[0], -1).numpy()
            dests = [raw[i] for i in range(len(keys))]
        plan = list(plan)
        arrived = self._load_below(keys, plan, 0, dests)
        tiers: list[str] = []
        pos, replans = 0, 0
        while pos < len(keys) and not (cancel is not None and cancel.is_set()):
            if plan[pos] == HOST:
                end = pos
                while end < len(keys) and plan[end] == HOST:
                    end += 1
                assert buffer is not None
                with self._lock:
                    n = self._copy_from_host(keys[pos:end], buffer[pos:end])
                tiers += [Tier.HOST.value] * n
                pos += n
                placed = pos == end
            else:
                placed = arrived.get(pos, False)
                if placed:
                    tiers.append(self.chain.tiers[plan[pos]].name)
                    pos += 1
            if not placed:
                # The page moved since `match` (background demotion goes on while we read), or
                # its tier no longer holds it intact: look for the rest below again, a bounded
                # number of times; then the prefix ends here.
                if replans == _MAX_REPLANS or not self.chain.tiers:
                    break
                replans += 1
                where = self.chain.locate(keys[pos:], leading=True)
                cut = next((i for i, w in enumerate(where) if w is None or self.chain.tiers[w].name in skip),
                           len(where))
                keys, plan = keys[:pos + cut], plan[:pos] + [w for w in where[:cut] if w is not None]
                arrived.update(self._load_below(keys, plan, pos, dests))
        if tiers and len(set(tiers)) == 1:  # a rate per tier: mixed loads tell none
            self._observe(tiers[0], time.perf_counter() - started, len(tiers))
        return Loaded(buffer, pos, tiers)

    def load_into_pool(self, keys: list[bytes], plan: list[int], pages: np.ndarray, skip: frozenset[str]) -> Loaded:
        """`load` straight into the device `pages` of a CPU pool (`fills_pool`)."""
        return self.load(keys, plan, pages=pages, skip=skip)

    def give_back(self, loaded: Loaded) -> None:
        """The staging buffer of a load whose pages are in place (or dropped); none for a load
        into device pages."""
        if loaded.buffer is not None:
            self.staging.give_back(loaded.buffer)

    def give_back_when_done(self, future: Future[Any]) -> None:
        """A prefetch nobody will load: its buffer returns once it ends."""
        def done(f: Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.give_back(f.result())

        future.add_done_callback(done)

    def warm(self) -> None:
        """Start the prefetch threads, and on CUDA pin a staging buffer as large as the pool (at
        most `_WARM_STAGING_BYTES`): pinning costs far more than the copy it serves."""
        with self._start_lock:
            executor = self._executor = self._executor or ThreadPoolExecutor(
                self._workers, thread_name_prefix="tiered-cache-prefetch")
        for _ in range(self._workers):
            executor.submit(time.sleep, 0.01)
        if self.staging.pin:
            pages = min(self.pool.num_pages, max(1, _WARM_STAGING_BYTES // self.spec.bytes_per_page))
            self.staging.give_back(self.staging.lease(pages))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    # --- internals ------------------------------------------------------------------------------
    def _pool_dest(self, page: int) -> PageDest:
        """Device page `page` of a CPU pool as a page destination (codec.py): its (layers, 2,
        bytes) blocks, strided in the layer-first pool, in page-first order."""
        assert self._pool_bytes is not None
        return self._pool_bytes[:, :, page].transpose(1, 0, 2)

    def _load_below(self, keys: list[bytes], plan: list[int], start: int, dests: list[PageDest]) -> dict[int, bool]:
        """Load the planned lower-tier pages at positions >= `start` into their destinations (one
        call per tier); whether each arrived, by position."""
        below = [i for i in range(start, len(keys)) if plan[i] != HOST]
        if not below:
            return {}
        got = self.chain.get_into([keys[i] for i in below], [plan[i] for i in below], [dests[i] for i in below],
                                    self.spec)
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
