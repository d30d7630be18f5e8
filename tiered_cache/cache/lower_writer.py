"""`LowerWriter`: write-behind from host RAM to the blob tiers below (disk, Redis, store servers).

Host RAM drops a page (its LRU end) -> the page is queued for the first lower tier and served
from memory until the put is done (`in_flight`), so write-behind never opens a window of misses.
Pages host RAM drops are kept in their rows while the writer has them (`retain`, at most
1/_RETAIN_SHARE of host RAM), copied out past that (`host_evicted`). The queue is bounded: when
it is full the writes are dropped and counted (`pages_dropped`), never waited for.

The writer runs on its own background thread at a lower priority and steps aside for requests
in progress and for demotions (room on the device is what the next request needs; a write below
is not).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from tiered_cache.cache.background import BACKGROUND_NICE, BackgroundQueue, QueueOwner
from tiered_cache.cache.foreground import YIELD_S
from tiered_cache.tiers.readdress import readdress
from tiered_cache.wire.codec import encode_page

if TYPE_CHECKING:
    import threading

    from tiered_cache.cache.foreground import Foreground
    from tiered_cache.config import CacheConfig
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.tiers.chain import TierChain
    from tiered_cache.tiers.host import HostTier


class WriterSurroundings(Protocol):
    """What the writer reads of the cache it serves (`CacheCore`, which builds it before host RAM:
    host RAM is read when called). Declared here, so the core's module, which imports this one,
    is not imported back."""

    spec: KVSpec
    config: CacheConfig
    chain: TierChain
    lock: threading.RLock
    foreground: Foreground
    demotions_idle: threading.Event
    in_flight: dict[bytes, torch.Tensor]
    host: HostTier
    closed: bool

_NO_PAGES = np.empty(0, dtype=np.int64)
# Bytes the writer encodes and puts between looks for a quiet moment: a request that arrives
# mid-chunk shares the cores with it for at most one chunk (docs/PERFORMANCE.md).
_WRITE_CHUNK_BYTES = 1 << 20
_RETAIN_SHARE = 4  # at most 1/4 of host RAM rows wait for the writer; past that, pages are copied


class LowerWriter(QueueOwner):
    """Puts pages host RAM holds or dropped into the tiers below, in the background. Built by the
    core before host RAM, which calls back here: host RAM is read from the core when called."""

    def __init__(self, core: WriterSurroundings) -> None:
        super().__init__(BackgroundQueue("lower-writer", capacity=core.config.demotion_queue, nice=BACKGROUND_NICE))
        self.core = core
        self.spec, self.config, self.chain = core.spec, core.config, core.chain
        self._lock = core.lock  # guards host RAM metadata and `in_flight`
        self.in_flight = core.in_flight  # pages queued here, served from memory until put below
        self.pages_dropped = 0  # pages whose write below was dropped (the queue was full)

    # --- host RAM's callbacks (lock held) ---------------------------------------------------------
    def retain(self, keys: list[bytes], rows: np.ndarray) -> np.ndarray:
        """Host RAM is dropping these pages: keep the rows of those the first lower tier lacks
        until they are put below, so nothing is copied on the request path. Until then they are
        served from their rows. Past 1/_RETAIN_SHARE of host RAM the pages are copied out and
        queued (`host_evicted`). Returns the rows kept."""
        host = self.core.host
        if not self.chain.tiers:
            return _NO_PAGES
        todo = [i for i, k in enumerate(keys) if not self.chain.known_in(k, 0)]
        budget = max(0, host.num_rows // _RETAIN_SHARE - host.num_retained)
        if len(todo) > budget:
            rest = todo[budget:]
            self.host_evicted([keys[i] for i in rest], host.slab[torch.from_numpy(rows[rest])])
            todo = todo[:budget]
        if not todo:
            return _NO_PAGES
        kept = rows[todo]
        views = [host.slab[int(row)] for row in kept]
        chosen = [keys[i] for i in todo]
        if not self.queue.submit(self._write_below, chosen, views, kept):
            self.pages_dropped += len(todo)
            return _NO_PAGES
        for key, view in zip(chosen, views, strict=True):
            self.in_flight[key] = view
        return kept

    def host_evicted(self, keys: list[bytes], pages: torch.Tensor) -> None:
        """Pages that did not fit in host RAM at all (a copy): queue them for the tiers below, unless
        the first lower tier is known to hold them already."""
        if not self.chain.tiers:
            return
        todo = [i for i, k in enumerate(keys) if not self.chain.known_in(k, 0)]
        if not todo:
            return
        chosen = pages if len(todo) == len(keys) else pages[torch.tensor(todo)]
        chosen_keys = [keys[i] for i in todo]
        if self.queue.submit(self._write_below, chosen_keys, chosen):
            for key, page in zip(chosen_keys, chosen, strict=True):
                self.in_flight[key] = page
        else:
            self.pages_dropped += len(chosen_keys)

    # --- jobs queued from elsewhere ---------------------------------------------------------------
    def queue_host_pages(self, keys: list[bytes], tiers: Sequence[int]) -> None:
        """Put the pages of `keys` host RAM holds into lower `tiers` (write-through), in the background."""
        self.queue.submit(self.write_host_below, keys, tiers)

    def set_remote_addresses(self, addresses: Sequence[str]) -> bool:
        """Point the remote tier at `addresses`; forget what moved, put what host RAM holds to the
        keys' new owners in the background (`TieredCache.set_remote_addresses`)."""
        readdressed = readdress(self.chain, addresses)
        if readdressed is None:
            return False
        index, moved = readdressed
        if addresses and not self.queue.submit(self._republish, index, moved):
            self.pages_dropped += 1  # the queue is full: counted, not waited for
        return True

    def _republish(self, index: int, moved: Callable[[bytes], bool]) -> None:
        """Background: put the pages host RAM holds whose owner moved into lower tier `index`."""
        with self._lock:
            held = list(self.core.host.index)
        self.write_host_below([k for k in held if moved(k)], [index])  # hashing outside the lock

    def write_host_below(self, keys: list[bytes], tiers: Sequence[int]) -> None:
        """Background: put the pages of `keys` host RAM holds into lower `tiers`, a chunk at a time
        after a quiet moment, each chunk copied out of host RAM under the lock only for that chunk."""
        step = max(1, _WRITE_CHUNK_BYTES // self.spec.bytes_per_page)
        for start in range(0, len(keys), step):
            self._step_aside()
            with self._lock:
                if self.core.closed:
                    return
                found, pages = self.core.host.copy_out(keys[start:start + step])
            items = self._encode_politely(found, pages)
            for index in tiers:
                self._step_aside()
                self.chain.put(items, index, demotion=True)

    def _write_below(self, keys: list[bytes], pages: Any, rows: np.ndarray | None = None) -> None:
        """Background: encode pages host RAM dropped and put them into the first lower tier; they
        stop being served from memory then, and `rows` (pages still held in host rows, when
        `retain` kept them) are given back."""
        try:
            step = max(1, _WRITE_CHUNK_BYTES // self.spec.bytes_per_page)
            for start in range(0, len(keys), step):
                items = self._encode_politely(keys[start:start + step], pages[start:start + step])
                self._step_aside()
                self.chain.put(items, 0, demotion=True)
        finally:
            with self._lock:
                for key in keys:
                    self.in_flight.pop(key, None)
                if rows is not None:
                    self.core.host.release(rows)

    def _step_aside(self) -> None:
        """Wait until no demotion is under way and no request is in progress (at most `YIELD_S`
        for each): room on the device is what the next request needs, a write below is not."""
        self.core.demotions_idle.wait(YIELD_S)
        self.core.foreground.wait_idle(YIELD_S)

    def _encode_politely(self, keys: list[bytes], pages: Any) -> list[tuple[bytes, bytes]]:
        """(key, blob) of each page, each encoded after `_step_aside`. Per page, not per chunk:
        encoding and the client's gRPC work hold the GIL, and a request thread (or the demoter)
        that let the GIL go gets it back only when this thread blocks or after the interpreter's
        switch interval; checked per chunk, a request that arrived mid-chunk waited for the whole
        chunk, and a demotion that started mid-chunk stretched past the idle gap."""
        items = []
        for key, page in zip(keys, pages, strict=True):
            self._step_aside()
            items.append((key, self._encode(page, key)))
        return items

    def _encode(self, page: torch.Tensor, key: bytes) -> bytes:
        return encode_page(page, self.spec, key, self.config.codec, self.config.codec_min_saving)
