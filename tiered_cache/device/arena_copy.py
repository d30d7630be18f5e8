"""`ArenaCopier`: pages from a same-host store server's arena straight into pool pages.

The arena (shm/arena.py) is mapped read-only in this process. On CUDA the map is registered with
the driver once (page-locked, read-only), and then:

    arena --(one DMA per run of adjacent blobs, copy stream)--> device chunk buffer
    device chunk buffer --(payload rows picked out, scatter kernel, same stream)--> pool pages

with no copy into host RAM. Meanwhile, on CPU threads that release the GIL, each blob is checked
where it lies in the arena: header (page key, model, shape, raw codec) and CRC-32C. After the
copies have finished, each page is checked `intact` (the arena did not write over it during the
DMA). Only the leading pages that pass all of it count as arrived: the caller puts those in the
tree and frees the rest, which the engine computes (a mismatch is a miss, never wrong KV).

Where the driver will not register a map (`cudaHostRegisterReadOnly` is not supported on every
platform) its pages are staged instead, still in a pipeline, not one whole pass after another:

    arena --(checker threads: copied and checksummed in one pass, checksum.py)--> pinned host chunk
    pinned host chunk --(one DMA, copy stream)--> device chunk buffer --(scatter)--> pool pages

with two host chunks, so the threads fill one while the other crosses the link: the load runs at
the slower of the two (the threads' copy rate, the link), not at the sum of their times.

On a CPU pool the same logic runs with a chunk buffer in memory and no streams, so it is tested
without a GPU (both ways: `direct=False` stages every page). Blobs that are not raw (compressed)
are not taken here: `TierLoads`' staged path decodes them.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from tiered_cache.device.arena_registry import ArenaRegistry, cuda_registry, error_name
from tiered_cache.device.copy_stream import CopyStream, QueuedCopy, chunks
from tiered_cache.device.pool import PagePool, device_index
from tiered_cache.shm.arena import DATA
from tiered_cache.shm.arena_map import ArenaMap
from tiered_cache.wire.checksum import checker_threads
from tiered_cache.wire.codec import BlobError, decode_into, raw_blob_size, raw_header_size, verify_raw_blob

log = logging.getLogger("tiered_cache.device.arena_copy")

DEFAULT_CHUNK_BYTES = 64 * 2**20
# Staged chunks are smaller: the first chunk's fill and the last one's DMA are not overlapped, and
# a chunk gives each of up to 8 checker threads a few pages.
STAGED_CHUNK_BYTES = 32 * 2**20

ArenaPage = tuple[ArenaMap, int, int]  # the arena as mapped here, position, length


class ArenaCopier:
    """Copies pages that lie in arenas into pool pages (`to_pool`)."""

    def __init__(self, pool: PagePool, chunk_bytes: int = DEFAULT_CHUNK_BYTES, checkers: int | None = None,
                 direct: bool = True, registry: ArenaRegistry | None = None) -> None:
        self.pool = pool
        self.direct = direct  # False: stage every page through host chunks, as for a map the driver refused
        self.spec = pool.spec
        self.cuda = pool.device.type == "cuda"
        # Which maps are registered with the driver: the process's (CUDA), or none needed (CPU).
        if registry is None and self.cuda:
            registry = cuda_registry(pool.device)
        self.registry = registry
        self.blob_bytes = raw_blob_size(self.spec)
        self.header_bytes = raw_header_size(self.spec)
        self.chunk_blobs = max(1, chunk_bytes // self.blob_bytes)
        self.staged_blobs = max(1, min(self.chunk_blobs, STAGED_CHUNK_BYTES // self.blob_bytes))
        self._buffer: torch.Tensor | None = None
        self._copies: CopyStream | None = None
        self._usable: weakref.WeakSet[ArenaMap] = weakref.WeakSet()  # maps registered when this copier asked
        self._hosts: torch.Tensor | None = None  # the two host chunks pages are staged through (pinned on CUDA)
        self._staging = threading.Lock()  # one staged transfer at a time uses them
        self._making = threading.Lock()  # the chunk buffer and copy stream are made once
        self._refusal_said = False
        self.checkers = checkers or checker_threads()
        self._checker = ThreadPoolExecutor(self.checkers, thread_name_prefix="tiered-cache-arena-crc")
        self.refused = 0  # pages whose blob failed its checks (counted, then a miss)
        self.lost = 0  # pages the arena wrote over during the copy (a miss)
        self.copied = 0  # pages that arrived verified and intact
        self.staged = 0  # of those, pages staged through host chunks (a map not registered, or `direct=False`)
        # Where `to_pool`'s time goes, summed over calls (`figures`): the copy stream's time from
        # the first DMA queued to the last scatter (DMA, payloads picked out, scatter, and any gap
        # while the host queued the next chunk; on the CPU: the copies as they ran), the checks
        # from the first handed out to the last done (staged: the threads' copies with their
        # checks), and the whole call.
        self.calls = 0
        self.copy_s = self.check_s = self.call_s = 0.0

    def usable(self, arena: ArenaMap) -> bool:
        """Whether pages of `arena` can be copied straight from it (on CUDA: its map registered
        with the driver, once per process: arena_registry.py; False when the driver refuses, then
        its pages are staged through host chunks)."""
        if not self.direct:
            return False
        registry = self.registry
        if registry is None:
            return True
        if arena in self._usable and registry.held(arena):  # not once it was closed and unregistered
            return True
        err = registry.ensure(arena)  # a refusal is remembered there: the driver is not asked each load
        if err:
            # Said once per copier: from here these pages are staged through host chunks, at the
            # checker threads' copy rate, and whoever reads the figures should know why.
            if not self._refusal_said:
                self._refusal_said = True
                log.warning("CUDA would not register the store's arena %s (%.1f GiB, read-only): error %d (%s); "
                            "its pages are staged through pinned host chunks instead", arena.path,
                            arena.size / 2**30, err, error_name(err))
            return False
        self._usable.add(arena)
        return True

    def to_pool(self, keys: Sequence[bytes], where: Sequence[ArenaPage], pages: Any) -> int:
        """Copy page `keys[i]`, lying at `where[i]`, into pool page `pages[i]`; returns how many
        leading pages arrived verified and intact (the rest hold anything: free them)."""
        assert len(where) == len(keys) and len(pages) >= len(keys)
        # Only raw pages of this model are copied as they lie; a page of another size (compressed)
        # ends the run here, and the caller's staged path decodes it.
        n = next((i for i, (_, _, length) in enumerate(where) if length != self.blob_bytes), len(keys))
        keys, where = keys[:n], where[:n]
        if not n:
            return 0
        pages = np.asarray(pages[:n], dtype=np.int64)
        self.pool.check_pages(pages)
        started = time.perf_counter()
        direct = all(self.usable(arena) for arena in {id(w[0]): w[0] for w in where}.values())
        try:
            ok = self._direct(keys, where, pages) if direct else self._staged(keys, where, pages)
        finally:
            self.calls += 1
            self.call_s += time.perf_counter() - started
        arrived = 0
        for good, (arena, position, length) in zip(ok, where, strict=True):
            if not good:
                break
            if not arena.intact(position, length):  # after the copy: the bytes copied are the bytes checked
                self.lost += 1
                break
            arrived += 1
        self.copied += arrived
        if not direct:
            self.staged += arrived
        return arrived

    def _direct(self, keys: Sequence[bytes], where: Sequence[ArenaPage], pages: np.ndarray) -> list[bool]:
        """Pages straight from the (registered) maps: the copies queued first, then the blobs
        checked where they lie on the checker threads while the copies run; returns each page's
        check, once the copies are done."""
        n = len(keys)
        started = time.perf_counter()
        queued = self._copy(where, pages)
        checking = time.perf_counter()
        try:
            ok = self._on_threads(keys, where)
        finally:
            self.check_s += time.perf_counter() - checking
            if queued is not None:
                queued.wait()  # the caller may free or reuse the pages once this returns
            self.copy_s += queued.seconds() if queued is not None else checking - started
        assert len(ok) == n
        return ok

    def _staged(self, keys: Sequence[bytes], where: Sequence[ArenaPage], pages: np.ndarray) -> list[bool]:
        """Pages staged chunk by chunk: the checker threads copy and check a chunk's blobs into
        one host chunk while the previous chunk's DMA and scatter run on the copy stream from the
        other; returns each page's check, once the copies are done."""
        self._ready()
        # Made on the caller's stream, read on the copy stream: safe because it lives until the
        # host has waited for every chunk below (a per-chunk index would need `record_stream`).
        index = device_index(pages, self.pool.device)
        ok: list[bool] = []
        with self._staging:
            hosts = self._host_chunks()
            queued: list[QueuedCopy | None] = [None, None]
            try:
                for c, (start, end) in enumerate(chunks(len(keys), self.staged_blobs)):
                    slot = c % 2
                    self._settle(queued, slot)  # the DMA that last read this host chunk is done
                    rows = hosts[slot, :end - start]
                    filling = time.perf_counter()
                    checked = self._on_threads(keys[start:end], where[start:end], rows.numpy())
                    self.check_s += time.perf_counter() - filling
                    ok += checked
                    # Only leading pages count: from a page that failed, nothing is worth moving.
                    good = next((i for i, passed in enumerate(checked) if not passed), len(checked))
                    if good:
                        uploading = time.perf_counter()
                        queued[slot] = self._upload(rows[:good], index[start:start + good], first=c == 0)
                        if queued[slot] is None:  # on the CPU: done already
                            self.copy_s += time.perf_counter() - uploading
                    if good < len(checked):
                        ok += [False] * (len(keys) - end)
                        break
            finally:
                for slot in (0, 1):
                    self._settle(queued, slot)  # the caller may free or reuse the pages once this returns
        return ok

    def _settle(self, queued: list[QueuedCopy | None], slot: int) -> None:
        copy = queued[slot]
        if copy is not None:
            queued[slot] = None
            copy.wait()
            self.copy_s += copy.seconds()

    def _upload(self, rows: torch.Tensor, index: torch.Tensor, first: bool) -> QueuedCopy | None:
        """One staged chunk (page-first rows in a host chunk) into its pool pages: on CUDA one DMA
        into the device chunk buffer and a scatter, on the copy stream (`QueuedCopy`: the host
        chunk stays untouched until it is done); on the CPU the scatter, from the rows. The copy
        stream waits for the caller's stream before the `first` chunk only; the caller's stream
        never waits: the host waits for every chunk before `to_pool` returns."""
        assert self._copies is not None and self._buffer is not None
        count = len(rows)
        host = rows.view(self.pool.kv.dtype).view(self.spec.staging_shape(count))
        buffer = self._buffer

        def chunk(start: int, end: int) -> None:
            if self.cuda:
                staging = buffer[:rows.numel()].view(self.pool.kv.dtype).view(self.spec.staging_shape(count))
                staging.copy_(host, non_blocking=True)
            else:
                staging = host
            self.pool.ops.scatter(self.pool.kv, index, staging)

        return self._copies.run(count, count, chunk, wait=False, follow_caller=first, caller_waits=False)

    def _host_chunks(self) -> torch.Tensor:
        """The two host chunks (2, staged chunk pages, page bytes) staged pages go through; pinned
        on CUDA, so each crosses in one asynchronous DMA at the link's speed. Made at the first
        staged load (which pays for pinning them: tens of ms)."""
        if self._hosts is None:
            with torch.inference_mode(False):
                self._hosts = torch.empty((2, self.staged_blobs, self.spec.bytes_per_page), dtype=torch.uint8,
                                          pin_memory=self.cuda)
        return self._hosts

    def _on_threads(self, keys: Sequence[bytes], where: Sequence[ArenaPage],
                    rows: np.ndarray | None = None) -> list[bool]:
        """`_check` of each page (copied into its row of `rows`, if given) on the checker threads,
        one share of the pages each (every k-th, so the host hands out a few tasks, not one per
        page); each page's result."""
        n = len(keys)
        k = min(self.checkers, n)
        shares: list[Future[list[bool]]] = []
        try:
            for i in range(k):
                args = (keys[i::k], where[i::k]) if rows is None else (keys[i::k], where[i::k], rows[i::k])
                shares.append(self._checker.submit(self._check_share, *args))
            ok = [False] * n
            for i, done in enumerate(shares):
                ok[i::k] = done.result()
            return ok
        finally:
            wait(shares)  # no check outlives the call, also when one raised

    def stats(self) -> dict[str, Any]:
        """Counters and where the time went, summed over `to_pool` calls (see __init__), and
        whether the driver took the arenas (`registered`: on CUDA; the DMA path needs it)."""
        return {"calls": self.calls, "copied": self.copied, "staged": self.staged, "refused": self.refused,
                "lost": self.lost,
                "copy_s": self.copy_s, "check_s": self.check_s, "call_s": self.call_s,
                "checkers": self.checkers, "registered": len(self._usable)}

    def _check_share(self, keys: Sequence[bytes], where: Sequence[ArenaPage],
                     rows: np.ndarray | None = None) -> list[bool]:
        into = [None] * len(keys) if rows is None else rows
        return [self._check(key, page, row) for key, page, row in zip(keys, where, into, strict=True)]

    def _check(self, key: bytes, page: ArenaPage, into: np.ndarray | None = None) -> bool:
        """Whether the blob at `page` is an intact raw blob of page `key`, checked where it lies;
        with `into` (a host row), copied there in the same pass (checked_copy.py)."""
        arena, position, length = page
        if length != self.blob_bytes:  # not a raw page of this model: the staged path decodes it
            return False
        view = arena.view(position, length)
        if view is None:  # written over already
            self.lost += 1
            return False
        try:
            if into is None:
                verify_raw_blob(view, self.spec, key)
            else:
                decode_into(view, self.spec, key, into)
        except BlobError:
            if arena.intact(position, length):
                self.refused += 1
            return False
        finally:
            view.release()
        return True

    def _copy(self, where: Sequence[ArenaPage], pages: np.ndarray) -> QueuedCopy | None:
        """Queue the copies chunk by chunk (runs of adjacent blobs in one arena: one DMA each) on
        the copy stream (copy_stream.py); the caller's stream waits for them, and so must the host
        before the pages are used or freed (the `QueuedCopy`; None on the CPU: done already)."""
        self._ready()
        buffer = self._buffer
        assert buffer is not None and self._copies is not None
        index = device_index(pages, self.pool.device)
        return self._copies.run(len(where), self.chunk_blobs,
                                lambda start, end: self._chunk(buffer, where[start:end], index[start:end]),
                                wait=False)

    def _chunk(self, buffer: torch.Tensor, where: Sequence[ArenaPage], index: torch.Tensor) -> None:
        """One chunk: each run of adjacent blobs DMA'd into the buffer as it lies (headers too),
        then the payloads picked out as page-first rows and scattered into the pool."""
        blob, header, page_bytes = self.blob_bytes, self.header_bytes, self.spec.bytes_per_page
        for i, arena, position, count in _adjacent_runs(where, blob):
            at = DATA + position % arena.capacity
            with warnings.catch_warnings():  # the map is read-only: torch only reads it here
                warnings.simplefilter("ignore", UserWarning)
                source = torch.frombuffer(arena.raw, dtype=torch.uint8, count=count * blob, offset=at)
            buffer[i * blob:(i + count) * blob].copy_(source, non_blocking=True)
        rows = buffer[:len(where) * blob].view(len(where), blob)[:, header:header + page_bytes]
        staging = rows.contiguous().view(self.pool.kv.dtype).view(self.spec.staging_shape(len(where)))
        self.pool.ops.scatter(self.pool.kv, index, staging)

    def _ready(self) -> None:
        with self._making:  # two first loads at once must share one buffer and one stream
            if self._buffer is None:
                with torch.inference_mode(False):
                    self._buffer = torch.empty(self.chunk_blobs * self.blob_bytes, dtype=torch.uint8,
                                               device=self.pool.device)
            if self._copies is None:
                self._copies = CopyStream(self.pool.device)

    def close(self) -> None:
        """Stop the check threads. The maps stay registered: another cache may read them, and each
        is unregistered when it is closed or collected (arena_registry.py)."""
        self._checker.shutdown(wait=True)


def _adjacent_runs(where: Sequence[ArenaPage], blob: int) -> list[tuple[int, ArenaMap, int, int]]:
    """(index, arena, first position, count) of each run of blobs lying one after the other."""
    runs: list[tuple[int, ArenaMap, int, int]] = []
    for i, (arena, position, _) in enumerate(where):
        if runs:
            start, last_arena, first, count = runs[-1]
            if (last_arena is arena and position == first + count * blob
                    and (first % arena.capacity) + (count + 1) * blob <= arena.capacity):
                runs[-1] = (start, arena, first, count + 1)
                continue
        runs.append((i, arena, position, 1))
    return runs

