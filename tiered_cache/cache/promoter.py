"""`Promoter`: brings a matched prefix's pages from below the device up into device pages.

The load (promotion) path of `TieredCache`, in one place:

- `plan`: where each page past the device prefix lives (host RAM, or which lower tier), asking
  each lower tier at most once.
- `prefetch`: start a `fetch` in the background (bounded: `max_prefetches` in flight, the rest
  declined and counted, `load` then fetches inline).
- `fetch`: bring the pages into their destinations: on a CPU pool, when none is in host RAM, the
  device pages the cache allocated for them (`fills_pool`), else (CUDA; a prefetch, whose pages
  are not allocated yet; host RAM pages, copied out before the allocation could evict them) a
  leased page-first staging buffer, pinned on CUDA. Host RAM pages are copied under the
  cache's lock (memory); lower-tier pages go straight from the tier into their destinations
  outside it (`TierChain.fetch_into`: no blob in between, each page verified where it lands).
  A page that moved meanwhile is looked for again, a bounded number of times.
- `host_to_pool`: host RAM slots straight into device pages, one DMA per run of slots on CUDA
  (`device/host_copy.py`), with no staging copy; it returns once the copies are queued (the
  caller's stream waits for them, the host slab's fence keeps their slots unwritten meanwhile).
- On CUDA, pages in a same-host store server's arena (shm/arena.py) go straight from there into
  device pages, one DMA per run of adjacent blobs (`device/arena_copy.py`), checked on CPU
  threads meanwhile (`from_arenas`, `fetch(pages=)`).

Copies from a tier below to the pool: one on a CPU pool (the tier's read lands in the page:
a file read, a socket read, a copy out of a same-host store server's arena), one DMA on CUDA
from such an arena, two through staging on CUDA otherwise or after a prefetch (that read, then
one DMA or copy into the pool). Nothing is put into host RAM on the way up.

Who owns what: the cache allocates device pages and hands them to the tree (it owns the
ledger); the promoter only fills pages it is given and staging buffers it leased.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiered_cache.cache.handle import HOST, Prefetch
from tiered_cache.cache.reuse import ReuseEstimates
from tiered_cache.cache.staging import StagingBuffers
from tiered_cache.cache.stats import Movements
from tiered_cache.config import CacheConfig
from tiered_cache.device.arena_copy import ArenaCopier
from tiered_cache.device.arena_registry import RegisterAhead, cuda_registry
from tiered_cache.device.copy_stream import QueuedCopy
from tiered_cache.device.host_copy import HostCopier
from tiered_cache.device.pool import PagePool
from tiered_cache.model.spec import KVSpec
from tiered_cache.tiers.chain import TierChain
from tiered_cache.tiers.host import HostTier
from tiered_cache.wire.codec import PageDest

_NOWHERE = -2  # in a plan being built: no tier found the page (HOST is -1, lower tiers >= 0)
# Reuse policy: a lower tier skipped as slower than recompute is re-measured (a background fetch of
# up to _PROBE_PAGES of the pages skipped) once its estimate is this old; at once (one probe a
# second at most) where the estimate priced more than it has seen (`Rate.extrapolates`), with
# enough of the skipped pages to see a larger size.
REUSE_REMEASURE_S = 30.0
REUSE_EXTRAPOLATED_PROBE_S = 1.0
_PROBE_PAGES = 8
_MAX_REPLANS = 3  # times one fetch looks again for pages that moved down while it ran



@dataclass
class Fetched:
    """Pages brought up from below, the first `n` valid: in a leased staging `buffer`, or (None)
    straight in the device pages the fetch was given."""

    buffer: torch.Tensor | None
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
        # Host RAM -> pool copies queued (CUDA), oldest first, with the pages they fill (pinned
        # until settled: `settle_host_copies`, at every match and load).
        self._host_copies: deque[tuple[QueuedCopy, np.ndarray]] = deque()
        self.last_host_copy: QueuedCopy | None = None  # the newest of them, done or not
        self.arena_copier: ArenaCopier | None = None  # on CUDA, made when a same-host store is first used
        # On CUDA, arenas of same-host store servers are registered with the driver as they are
        # mapped, not by the first load that reads one.
        self._register_ahead = (RegisterAhead(cuda_registry(pool.device))
                                if pool.kv.device.type == "cuda" and _reads_arenas(chain) else None)
        # On a CPU pool, pages from below land straight in their device pages: the pool is memory
        # too, and staging would be a second pass over every byte. Its bytes as
        # (K/V, layer, page, bytes): one page's blocks, in page-first order, are `_pool_dest`.
        self.fills_pool = pool.kv.device.type == "cpu"
        self._pool_bytes: np.ndarray | None = None
        if self.fills_pool:
            with torch.inference_mode(False):
                self._pool_bytes = pool.kv.view(torch.uint8).reshape(2, spec.num_layers, pool.num_pages, -1).numpy()
        self.declined = 0  # prefetches not started because max_prefetches were in flight
        # Reuse policy (reuse.py): `worth_loading` keeps only the leading pages that arrive sooner
        # than the engine would compute them. Load-rate samples: this promoter's loads (host RAM ->
        # pool, a whole fetch from one tier) and every batched fetch below (also inside mixed
        # fetches); prefill samples from the engine (`TieredCache.observe_prefill`).
        self.reuse = ReuseEstimates(config.reuse, config.prefill_tokens_per_s)
        self.chain.observe_fetches(self._fetched_pages, pages=True)
        self._probing: set[str] = set()  # lower tiers with a re-measuring probe running (`_probe_skipped`)
        self._probe_lock = threading.Lock()
        self._lock = lock  # the cache's: guards host RAM metadata and `in_flight`
        self._in_flight = in_flight  # pages on their way below, still served from memory
        self._workers = config.prefetch_workers
        self._slots = threading.BoundedSemaphore(config.max_prefetches)
        self._executor: ThreadPoolExecutor | None = None

    # --- where the pages are ------------------------------------------------------------------
    def plan(self, keys: Sequence[bytes], in_host: Sequence[bool], skip: frozenset[str] = frozenset()) -> list[int]:
        """Where each page of the leading run of `keys` found below the device lives: HOST, or
        the index of the lower tier to fetch it from. Each lower tier is asked at most once.
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

    def worth_loading(self, keys: Sequence[bytes], plan: list[int]) -> list[int]:
        """The leading part of `plan` (for `keys`) worth loading under the reuse policy: the pages
        cut off are counted per tier, and a lower tier among them whose estimate is stale is
        re-measured in the background."""
        keep = self.reuse_cut(plan)
        if keep < len(plan):  # the rest arrives later than the engine would compute it
            self.reuse.count_skipped([self.tier_name(where) for where in plan[keep:]])
            self._probe_skipped(list(keys[keep:len(plan)]), plan[keep:])
        return plan[:keep]

    def reuse_cut(self, plan: list[int]) -> int:
        """How many leading pages of `plan` to load under the reuse policy (reuse.py)."""
        names = {where: self.tier_name(where) for where in set(plan)}
        return self.reuse.cut(plan, names, self.spec.bytes_per_page, self.spec.page_size)

    def tier_name(self, where: int) -> str:
        return self.host.name if where == HOST else self.chain.tiers[where].name

    def _probe_skipped(self, keys: list[bytes], plan: list[int]) -> None:
        """Re-measure lower tiers skipped as slow whose estimate is `REUSE_REMEASURE_S` old, or
        that priced the skipped pages past what they have seen: a skipped tier is never fetched
        from, so nothing else would ever update it (a first fetch slowed by connecting, a link
        that recovered). Some of the skipped pages are fetched in the background and thrown
        away; the fetch observers take the sample. Host RAM is not probed: its copies run at
        memory speed, which does not drift the way a network does."""
        for index in sorted(set(plan) - {HOST}):
            tier = self.chain.tiers[index].name
            if tier in self._probing:  # one probe a tier at a time: a slow link's probe takes seconds
                continue
            skipped = [k for k, where in zip(keys, plan, strict=True) if where == index]
            rate = self.reuse.load_rate(tier)
            size = len(skipped) * self.spec.bytes_per_page
            if rate is not None and rate.extrapolates(size):
                # Judged on smaller loads only (a one-page first fetch is mostly its round trip):
                # measure this size now rather than skip the tier for REUSE_REMEASURE_S on a guess.
                if not self.reuse.due_for_probe(tier, REUSE_EXTRAPOLATED_PROBE_S, since_sample=False):
                    continue
                count = max(_PROBE_PAGES, 2 * math.ceil(rate.known_up_to / self.spec.bytes_per_page))
            elif self.reuse.due_for_probe(tier, REUSE_REMEASURE_S):
                count = _PROBE_PAGES
            else:
                continue
            chosen = skipped[:count]
            with self._probe_lock:
                if tier in self._probing:
                    continue
                self._probing.add(tier)

            def probe(chosen: list[bytes] = chosen, index: int = index, tier: str = tier) -> None:
                try:
                    with contextlib.suppress(Exception):  # a tier closed meanwhile: nothing to learn
                        self.chain.fetch(chosen, [index] * len(chosen))
                finally:
                    with self._probe_lock:
                        self._probing.discard(tier)

            threading.Thread(target=probe, name=f"tiered-cache-probe-{tier}", daemon=True).start()

    # --- moving them up -------------------------------------------------------------------------
    def host_to_pool(self, slots: np.ndarray, pages: np.ndarray) -> None:
        """Copy host RAM `slots` into device `pages` (caller holds the cache's lock, so the slots
        stay put until the copy is noted): one DMA per run of slots on CUDA, one strided copy per
        run on the CPU. On CUDA this returns once the copies are queued, the current stream waiting
        for them: the engine's forward is queued while the DMA runs. Until the copies end, the
        slab's fence (`HostTier.reading`) keeps the slots unwritten and a pin keeps the pages from
        being handed out again, should they be freed meanwhile (adopted as duplicates of pages
        another request loaded, or evicted); `settle_host_copies` lifts the pin and takes their
        time on the copy stream as the rate sample."""
        self.settle_host_copies()
        started = time.perf_counter()
        queued = self.copier.to_pool(self.host.slab, slots, pages, wait=False)
        if queued is None:
            self._observe("host", len(pages), time.perf_counter() - started)
            return
        self.pool.pin(pages)
        self.host.reading(queued)
        self._host_copies.append((queued, pages))
        self.last_host_copy = queued

    def settle_host_copies(self, wait: bool = False) -> None:
        """The host RAM -> pool copies that have finished (all, after waiting, with `wait`): their
        pages unpinned, their time sampled for the reuse policy (lock held)."""
        if wait and self.last_host_copy is not None:
            self.last_host_copy.wait()
        while self._host_copies and self._host_copies[0][0].finished():  # they finish in order
            queued, pages = self._host_copies.popleft()
            self.pool.unpin(pages)
            self._observe("host", len(pages), queued.seconds())

    def stream_waits_for_host_copies(self) -> None:
        """Make the current stream wait for the host RAM -> pool copies still running (the newest
        stands for all: they run in order on one copy stream). Pages are in the tree once their
        copy is queued, so a request on another stream that finds them, as a device hit, first
        waits here (`Loader.match`, `Loader.load`); the host does not block."""
        last = self.last_host_copy
        if last is not None and not last.finished():
            torch.cuda.current_stream(self.pool.device).wait_event(last.done)

    def staged_to_pool(self, fetched: Fetched, pages: np.ndarray) -> None:
        """Copy the first `len(pages)` fetched pages from their staging buffer into device `pages`."""
        self.copier.to_pool(fetched.buffer, np.arange(len(pages), dtype=np.int64), pages)

    def prefetch(self, keys: list[bytes], plan: list[int], skip: frozenset[str] = frozenset()) -> Prefetch | None:
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
                return self.fetch(keys, plan, cancel, skip=skip)
            finally:
                self._slots.release()

        return Prefetch(self._executor.submit(job), cancel)

    def fetch(self, keys: list[bytes], plan: list[int], cancel: threading.Event | None = None,
              pages: np.ndarray | None = None, skip: frozenset[str] = frozenset()) -> Fetched:
        """Bring the leading pages of `keys` (located by `plan`) up, page-first: into device
        `pages` (one per key) when given, for a plan with no page in host RAM on a CPU pool
        (`fills_pool`) or, on CUDA, one whose pages lie in same-host arenas (`from_arenas`; the
        caller owns the pages until it adopts them), else into a leased staging buffer. Host RAM
        pages are copied under the lock (memory), lower-tier pages go straight into their
        destinations outside it (one batched call per tier, each page verified where it lands).
        A page that left host RAM since `match` (demoted meanwhile) is looked for below again;
        the fetch stops at the first page that no longer arrives intact. Tiers named in `skip`
        (quarantined by the canary) are not looked in then either, as in `plan`."""
        started = time.perf_counter()
        buffer: torch.Tensor | None = None
        if pages is not None and not self.fills_pool:
            return self._fetch_from_arena(keys, plan, pages, started, skip)
        if pages is not None:
            assert len(pages) >= len(keys) and HOST not in plan, \
                "fetch into device pages: one page per key, none from host RAM"
            dests: list[PageDest] = [self._pool_dest(int(page)) for page in pages[:len(keys)]]
        else:
            buffer = self.staging.lease(len(keys))
            raw = buffer.view(torch.uint8).reshape(buffer.shape[0], -1).numpy()
            dests = [raw[i] for i in range(len(keys))]
        plan = list(plan)
        arrived = self._fetch_below(keys, plan, 0, dests)
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
                tiers += ["host"] * n
                pos += n
                landed = pos == end
            else:
                landed = arrived.get(pos, False)
                if landed:
                    tiers.append(self.chain.tiers[plan[pos]].name)
                    pos += 1
            if not landed:
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
                arrived.update(self._fetch_below(keys, plan, pos, dests))
        if tiers and len(set(tiers)) == 1:  # a rate per tier: mixed fetches tell none
            self._observe(tiers[0], len(tiers), time.perf_counter() - started)
        return Fetched(buffer, pos, tiers)

    def in_arenas(self, plan: Sequence[int]) -> bool:
        """Whether these planned pages are read in place in same-host store servers' arenas: the
        leading page's tier keeps pages in arenas of servers on this host (`arena_pages`), and
        nothing is planned from host RAM. A load then copies (CPU pool) or DMAs (CUDA) them
        straight into its device pages; a prefetch into staging would only add a copy."""
        if not plan or HOST in plan:
            return False
        tier = self.chain.tiers[plan[0]]
        return bool(getattr(tier, "arena_pages", None)) and tier.same_host

    def from_arenas(self, plan: Sequence[int]) -> bool:
        """Whether a CUDA load of these planned pages DMAs them from same-host arenas straight
        into its device pages (`fetch(pages=)`)."""
        return not self.fills_pool and self.in_arenas(plan)

    def _fetch_from_arena(self, keys: list[bytes], plan: list[int], pages: np.ndarray, started: float,
                          skip: frozenset[str]) -> Fetched:
        """The leading pages that lie in one tier's same-host arenas, DMA'd from there into
        `pages` (device/arena_copy.py: checked on CPU threads meanwhile, intact after; a map the
        driver would not register is staged through pinned host chunks there); from the first
        page that did not arrive that way (not in an arena, written over, refused), the rest by
        the staged path into the pages after."""
        if self.arena_copier is None:
            self.arena_copier = ArenaCopier(self.pool)
        index = plan[0]
        tier = self.chain.tiers[index]
        n = next((i for i, w in enumerate(plan) if w != index), len(plan))
        where = tier.arena_pages(keys[:n])
        lead = next((i for i, ref in enumerate(where) if ref is None), n)
        arrived = self.arena_copier.to_pool(keys[:lead], where[:lead], pages[:lead])
        tier.record_arena_reads(arrived, lead - arrived, arrived * self.spec.bytes_per_page)
        if arrived:
            self._observe(tier.name, arrived, time.perf_counter() - started)
        tiers = [tier.name] * arrived
        if arrived < len(keys):
            rest = self.fetch(keys[arrived:], plan[arrived:], skip=skip)
            try:
                self.staged_to_pool(rest, pages[arrived:arrived + rest.n])
            finally:
                self.give_back(rest)
            arrived += rest.n
            tiers += rest.tiers
        return Fetched(None, arrived, tiers)

    def give_back(self, fetched: Fetched) -> None:
        """The staging buffer of a fetch whose pages are in place (or dropped); none for a fetch
        into device pages."""
        if fetched.buffer is not None:
            self.staging.give_back(fetched.buffer)

    def give_back_when_done(self, future: Future[Any]) -> None:
        """A prefetch nobody will load: its buffer returns once it ends."""
        def done(f: Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.give_back(f.result())

        future.add_done_callback(done)

    def close(self) -> None:
        with self._lock:
            self.settle_host_copies(wait=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        if self.arena_copier is not None:
            self.arena_copier.close()
        if self._register_ahead is not None:
            self._register_ahead.close()

    # --- internals ------------------------------------------------------------------------------
    def _pool_dest(self, page: int) -> PageDest:
        """Device page `page` of a CPU pool as a page destination (codec.py): its (layers, 2,
        bytes) blocks, strided in the layer-first pool, in page-first order."""
        assert self._pool_bytes is not None
        return self._pool_bytes[:, :, page].transpose(1, 0, 2)

    def _fetch_below(self, keys: list[bytes], plan: list[int], start: int, dests: list[PageDest]) -> dict[int, bool]:
        """Bring the planned lower-tier pages at positions >= `start` into their destinations (one
        call per tier); whether each arrived, by position."""
        below = [i for i in range(start, len(keys)) if plan[i] != HOST]
        if not below:
            return {}
        got = self.chain.fetch_into([keys[i] for i in below], [plan[i] for i in below], [dests[i] for i in below],
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

    def _fetched_pages(self, tier: str, seconds: float, pages: int) -> None:
        """A batched fetch from a lower tier (a `TierChain` fetch observer), for the reuse policy:
        in page bytes, as plans count them (a compressed blob is smaller, yet spares a whole page)."""
        self.reuse.observe_load(tier, pages * self.spec.bytes_per_page, seconds)

    def _observe(self, tier: str, num_pages: int, seconds: float) -> None:
        if num_pages:
            self.reuse.observe_load(tier, num_pages * self.spec.bytes_per_page, seconds)


def _reads_arenas(chain: TierChain) -> bool:
    """Whether a tier of `chain` reads pages in same-host store servers' arenas (the remote tier)."""
    return any(hasattr(tier, "arena_pages") for tier in chain.tiers)
