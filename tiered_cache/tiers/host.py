"""Host RAM tier: decoded pages in one preallocated page-first slab, LRU by page key.

Host RAM is the staging area for device transfers, so it holds pages as they are (no codec, no
checksum: the bytes never leave the process) and moves them with single indexed copies. The slab
is allocated once and pinned when CUDA is present so device copies can be asynchronous; pinning
faults the memory in, and an unpinned slab is pre-touched by a daemon thread instead (first
touch is far slower than a copy: docs/PERFORMANCE.md), so construction returns at once. Only rows `put` wrote are
ever read.

Device copies out of the slab may still be running when a load returns (the engine queues its
forward meanwhile): each is noted with `reading`, and every write into the slab first waits for
those in flight (`before_write`), so a row freed and reused can never change under a copy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tiered_cache.device.allocator import PageAllocator
from tiered_cache.device.memory import allocate_pretouched
from tiered_cache.errors import KVShapeError
from tiered_cache.model.spec import KVSpec
from tiered_cache.model.units import parse_size
from tiered_cache.tiers.base import Tier, TierStats, leading_run

# Called with (keys, pages) about to leave host RAM; `pages` is a copy, page-first.
HostEvictCallback = Callable[[list[bytes], torch.Tensor], None]
# Called with (keys, rows) about to leave host RAM; returns the rows it keeps (reads them at
# `slab[row]` later, e.g. to write them below) until it gives them back with `release`.
HostRetainCallback = Callable[[list[bytes], np.ndarray], np.ndarray]
# Called with (keys, held) when keys enter (True) or leave (False) host RAM: KV events.
HostChangeCallback = Callable[[list[bytes], bool], None]


class HostTier:
    name = Tier.HOST.value

    def __init__(self, spec: KVSpec, capacity: int | str, pin: bool | None = None,
                 on_evict: HostEvictCallback | None = None, retain: HostRetainCallback | None = None) -> None:
        self.spec = spec
        num_rows = parse_size(capacity) // spec.bytes_per_page
        if num_rows <= 0:
            raise ValueError(f"host capacity {capacity!r} holds no page of {spec.bytes_per_page:,} bytes")
        pin = torch.cuda.is_available() if pin is None else pin
        self.slab, self.pretouch = allocate_pretouched(spec.staging_shape(num_rows), spec.dtype.torch,
                                                       pin_memory=pin)
        self.rows = PageAllocator(num_rows)
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> row, least recently used first
        self.on_evict = on_evict
        self.retain = retain
        self.on_change: HostChangeCallback | None = None
        self.num_retained = 0  # rows dropped from the index but still held by `retain`'s owner
        self._reads: list[Any] = []  # device copies out of the slab that may be running (`reading`)
        self._reads_lock = threading.Lock()
        self._stats = TierStats(self.name, capacity_bytes=num_rows * spec.bytes_per_page)

    @property
    def num_rows(self) -> int:
        return self.rows.num_pages

    def contains_prefix(self, keys: Sequence[bytes]) -> int:
        return leading_run(key in self.index for key in keys)

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """Copy the leading run of held `keys` into `out` (or a new tensor); returns (n, pages[:n])."""
        n = self.contains_prefix(keys)
        if out is None:
            out = torch.empty(self.spec.staging_shape(n), dtype=self.slab.dtype)
        elif out.shape[1:] != self.slab.shape[1:] or out.shape[0] < n or out.dtype != self.slab.dtype:
            raise KVShapeError(f"out must be at least {self.spec.staging_shape(n)} {self.slab.dtype}, "
                               f"got {tuple(out.shape)} {out.dtype}")
        rows = [self.index[k] for k in keys[:n]]
        for key in keys[:n]:
            self.index.move_to_end(key)
        if n:
            torch.index_select(self.slab, 0, torch.tensor(rows), out=out[:n])
        self._stats.hits += n
        self._stats.misses += len(keys) - n
        self._stats.bytes_out += n * self.spec.bytes_per_page
        return n, out[:n]

    def hold(self, keys: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """Take held `keys` out of the index, their rows kept allocated, so no eviction can reach
        them (the caller holds its lock until `unhold`, so no reader misses them meanwhile)."""
        return [(key, self.index.pop(key)) for key in keys if key in self.index]

    def unhold(self, held: list[tuple[bytes, int]]) -> None:
        """Put `hold`'s keys back, most recently used. A key stored again meanwhile (the same
        content, under its own row) keeps that row; the held one is freed."""
        duplicates = []
        for key, row in held:
            if key in self.index:
                duplicates.append(row)
                self.index.move_to_end(key)
            else:
                self.index[key] = row
        if duplicates:
            self.rows.free(np.array(duplicates, dtype=np.int64))

    def copy_out(self, keys: Sequence[bytes]) -> tuple[list[bytes], torch.Tensor]:
        """A copy of the pages of those `keys` held here (any of them, not only a leading run),
        without touching recency or counters: background work, not a read on behalf of a request."""
        found = [k for k in keys if k in self.index]
        rows = torch.tensor([self.index[k] for k in found], dtype=torch.int64)
        return found, torch.index_select(self.slab, 0, rows)

    def leading_rows(self, keys: Sequence[bytes]) -> np.ndarray:
        """The rows of the leading run of held `keys`, marked as used and counted as hits, for a
        caller that copies straight out of `slab` (holding its lock, so the rows stay put)."""
        n = self.contains_prefix(keys)
        rows = np.fromiter((self.index[k] for k in keys[:n]), dtype=np.int64, count=n)
        for key in keys[:n]:
            self.index.move_to_end(key)
        self._stats.hits += n
        self._stats.bytes_out += n * self.spec.bytes_per_page
        return rows

    def put(self, keys: Sequence[bytes], pages: torch.Tensor) -> int:
        """Store page-first `pages` under `keys`; returns how many new pages were copied in.

        Keys already held are only marked as used (a key names its content). To make room the
        least recently used pages are evicted through `retain` / `on_evict`; pages beyond what the
        slab can hold are handed to `on_evict` directly, earliest pages kept (they head the prefix).
        """
        if tuple(pages.shape) != self.spec.staging_shape(len(keys)) or pages.dtype != self.slab.dtype:
            raise KVShapeError(f"pages must be {self.spec.staging_shape(len(keys))} {self.slab.dtype}, "
                               f"got {tuple(pages.shape)} {pages.dtype}")
        new, rows, overflow = self.reserve(keys)
        if new:
            source = pages if len(new) == len(keys) else pages[torch.tensor(new)]  # skip a copy when all new
            self.copy_in(rows, source)
            self.fill([keys[i] for i in new], rows)
        if overflow and self.on_evict:
            self._stats.evictions += len(overflow)
            self.on_evict([keys[i] for i in overflow], pages[torch.tensor(overflow)].contiguous())
        return len(new)

    # A put in three steps, for callers that copy without holding their lock: `reserve` and
    # `fill` change metadata (under the caller's lock); `copy_in` writes rows that are allocated
    # but not yet indexed, so no one else reads or reuses them meanwhile.
    def reserve(self, keys: Sequence[bytes]) -> tuple[list[int], np.ndarray, list[int]]:
        """Rows for the keys not held yet (held ones are marked as used), evicting to make room:
        (positions in `keys` that got a row, their rows, positions that did not fit)."""
        new: list[int] = []
        seen: set[bytes] = set()
        for i, key in enumerate(keys):
            if key in self.index:
                self.index.move_to_end(key)
            elif key not in seen:
                seen.add(key)
                new.append(i)
        room = self.num_rows - (len(keys) - len(new))  # held batch keys are pinned by being most recent
        self.make_room(min(len(new), room))
        room = min(room, self.rows.num_free)  # retained rows may leave less room than asked
        overflow, new = new[room:], new[:room]
        return new, self.rows.allocate(len(new)), overflow

    def copy_in(self, rows: np.ndarray, pages: torch.Tensor) -> None:
        """Write page-first `pages` into reserved `rows`."""
        if len(rows):
            self.before_write()
            _copy_into_rows(self.slab, rows, pages)

    def before_write(self) -> None:
        """Call before writing into reserved rows of `slab` directly (e.g. a device copy): waits
        for the device copies out of the slab still in flight (`reading`)."""
        if self.pretouch is not None:
            self.pretouch.before_write()
        with self._reads_lock:
            reads = list(self._reads)
        for copy in reads:  # not popped first: a concurrent writer must wait for them too
            copy.wait()
        if reads:
            with self._reads_lock:
                self._reads = [copy for copy in self._reads if not copy.finished()]

    def reading(self, copy: Any) -> None:
        """Note a device copy out of slab rows still in flight (`finished()`, `wait()`: a
        `QueuedCopy`), noted before its rows can be freed; until it finishes no write goes into the slab."""
        with self._reads_lock:
            self._reads = [read for read in self._reads if not read.finished()]
            self._reads.append(copy)

    def fill(self, keys: Sequence[bytes], rows: np.ndarray) -> None:
        """Index reserved `rows`, now written, under `keys`. A key stored meanwhile by another
        put keeps its row; the duplicate row is freed."""
        duplicates, added = [], []
        for key, row in zip(keys, rows.tolist(), strict=True):
            if key in self.index:
                duplicates.append(row)
            else:
                self.index[key] = row
                added.append(key)
        if duplicates:
            self.rows.free(np.array(duplicates, dtype=np.int64))
        if added and self.on_change is not None:
            self.on_change(added, True)
        self._stats.bytes_in += (len(keys) - len(duplicates)) * self.spec.bytes_per_page

    def delete(self, keys: Sequence[bytes]) -> None:
        gone = [k for k in keys if k in self.index]
        rows = [self.index.pop(k) for k in gone]
        self.rows.free(np.array(rows, dtype=np.int64))
        if gone and self.on_change is not None:
            self.on_change(gone, False)

    def stats(self) -> TierStats:
        self._stats.pages = len(self.index)
        self._stats.used_bytes = len(self.index) * self.spec.bytes_per_page
        return self._stats

    def release(self, rows: np.ndarray) -> None:
        """Give back rows kept through `retain`: they become free."""
        self.rows.free(rows)
        self.num_retained -= len(rows)

    def make_room(self, n: int) -> None:
        """Evict least recently used pages until `n` rows are free or nothing is left. Victims go
        to `retain` when set (it may keep their rows: no copy), else, copied, to `on_evict`."""
        # Rows kept by `retain` stay in use, so evict until the room is there (`retain` must bound
        # what it keeps, or host RAM empties behind a slow writer) or nothing is left.
        while self.rows.num_free < n and self.index:
            shortfall = min(n - self.rows.num_free, len(self.index))
            victims = [self.index.popitem(last=False) for _ in range(shortfall)]
            keys = [key for key, _ in victims]
            rows = np.array([row for _, row in victims], dtype=np.int64)
            if self.on_change is not None:
                self.on_change(keys, False)
            kept = np.empty(0, dtype=np.int64)
            if self.retain is not None:
                kept = self.retain(keys, rows)
            elif self.on_evict is not None:
                self.on_evict(keys, self.slab[torch.from_numpy(rows)])
            self.num_retained += len(kept)
            self.rows.free(np.setdiff1d(rows, kept) if len(kept) else rows)
            self._stats.evictions += shortfall


def _copy_into_rows(slab: torch.Tensor, rows: np.ndarray, pages: torch.Tensor) -> None:
    """slab[rows[i]] = pages[i], one copy per run of consecutive rows (freshly allocated rows
    mostly are): plain copies run at memcpy speed, `index_copy_` slower
    (docs/PERFORMANCE.md, "Tiers: host RAM, disk, Redis")."""
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    for start, end in zip(np.r_[0, breaks], np.r_[breaks, len(rows)], strict=True):
        first = int(rows[start])
        slab[first:first + (end - start)].copy_(pages[start:end])
