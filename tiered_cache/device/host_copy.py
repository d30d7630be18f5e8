"""`HostCopier`: pages between rows of a page-first host slab and the pool's pages, at the link's speed.

Host RAM keeps pages page-first (one page of all layers contiguous) and the pool layer-first, so
a page cannot cross as one contiguous copy. On CUDA the layout change is done where it is cheap:

    host rows --(one DMA per run of consecutive rows, copy stream)--> device chunk buffer
    device chunk buffer --(scatter kernel, same stream)--> pool pages

and the reverse for demotion (gather kernel into the chunk buffer, then one DMA per run of rows
into the slab). The DMA moves every byte once at PCIe speed; the kernel touches it again in HBM,
an order of magnitude faster, so the load runs close to a plain pinned host -> device copy of the same bytes.
Loads (host -> device) and demotions (device -> host) run on two copy streams, each with its own
chunk buffer (`chunk_bytes`, default 64 MiB, bounds the device memory each needs): PCIe is full
duplex, so a request's load never queues behind a demotion, and the two directions overlap. A
demotion's stream first waits for the loads queued before it (a page just loaded may be
demoted at once, and must be whole when it is read); loads wait for no demotion (a row a demotion
writes is not indexed until its copy is done, and a page it reads is not free until then). Within
a direction, each chunk is queued under a small lock, so transfers of several threads interleave
chunk by chunk, and a background transfer (`background=True`: demotion, write-through) waits for
each chunk before queueing the next, so a request's transfer queues behind one chunk, not a whole
transfer. The consumer's stream waits on an event recorded after the last kernel, and the call
returns only when the copy is done (also when it raised), because the caller's slab rows are
guaranteed to stay put, and its pages allocated, only until then; a caller that keeps them so
itself (the host tier's fence on its slab) passes `wait=False` and returns once the copies are queued.

On a CPU pool the pool is memory too: rows move into pages with one strided copy per run of
consecutive rows and pages, with no intermediate buffer. `chunked=True` there runs the CUDA
path's chunking on the CPU (a chunk buffer in memory, no streams), so its logic is tested
without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tiered_cache.device.copy_stream import CopyStream, QueuedCopy
from tiered_cache.device.pool import PagePool, consecutive_runs, device_index

DEFAULT_CHUNK_BYTES = 64 * 2**20


class HostCopier:
    """Copies page-first host rows into pool pages (`to_pool`) and back (`from_pool`)."""

    def __init__(self, pool: PagePool, chunk_bytes: int = DEFAULT_CHUNK_BYTES, chunked: bool | None = None) -> None:
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        self.chunked = self.cuda if chunked is None else chunked
        self.chunk_pages = max(1, chunk_bytes // pool.spec.bytes_per_page)
        self._loads: _Direction | None = None  # host -> device
        self._demotions: _Direction | None = None  # device -> host
        if self.cuda and self.chunked:
            self._streams_ready()  # made now: the first request that loads pays nothing for it

    def to_pool(self, source: torch.Tensor, rows: Any, pages: Any, background: bool = False,
                wait: bool = True) -> QueuedCopy | None:
        """pool page `pages[i]` = `source[rows[i]]` for page-first `source` (host memory: pinned on
        CUDA, for the DMA to run asynchronously at full speed). `background`: wait for each chunk
        before queueing the next, so a request's copy queues behind one chunk, not a transfer.
        `wait=False` (CUDA): return once queued, the current stream waiting for the copies; the
        caller keeps `source`'s rows untouched until the returned `QueuedCopy` is finished."""
        rows, pages = _as_index(rows), _as_index(pages)
        if not len(rows):
            return None
        if not self.chunked or source.device != torch.device("cpu"):
            self.pool.scatter_rows(pages, source, rows)
            return None
        index = self._device_index(pages)

        def chunk(buffer: torch.Tensor, start: int, end: int) -> None:
            for i, row, count in consecutive_runs(rows[start:end]):
                buffer[i:i + count].copy_(source[row:row + count], non_blocking=True)
            self.pool.ops.scatter(self.pool.kv, index[start:end], buffer[:end - start])

        return self._transfer(self._streams_ready()[0], len(rows), chunk, background, wait)

    def from_pool(self, pages: Any, dest: torch.Tensor, rows: Any, background: bool = False,
                  after: Sequence[Any] = ()) -> None:
        """`dest[rows[i]]` = pool page `pages[i]`, for page-first `dest` in host memory (the slab).
        `background` as for `to_pool`; `after`: CUDA events the copies wait for first (where the
        streams that wrote the pages had got to: writer_streams.py)."""
        rows, pages = _as_index(rows), _as_index(pages)
        if not len(rows):
            return
        if not self.chunked or dest.device != torch.device("cpu"):
            for i, row, count in consecutive_runs(rows):
                self.pool.gather(pages[i:i + count], out=dest[row:row + count])
            return
        index = self._device_index(pages)

        def chunk(buffer: torch.Tensor, start: int, end: int) -> None:
            self.pool.ops.gather(self.pool.kv, index[start:end], buffer[:end - start])
            for i, row, count in consecutive_runs(rows[start:end]):
                dest[row:row + count].copy_(buffer[i:i + count], non_blocking=True)

        loads, demotions = self._streams_ready()
        # Loads queued so far end before this reads their pages (a page loaded may be demoted at once).
        self._transfer(demotions, len(rows), chunk, background, after=[*after, *loads.mark()])

    def _device_index(self, pages: np.ndarray) -> torch.Tensor:
        """`pages`, checked (allocated, each once) and on the pool's device, once per transfer: the
        chunks then index slices of it, so no chunk waits on a small pageable upload of its own
        (which would stall the host until the copy stream drained, between every two chunks)."""
        self.pool.check_pages(pages)
        return device_index(pages, self.pool.device)

    def _transfer(self, direction: _Direction, n: int, chunk: Callable[[torch.Tensor, int, int], None],
                  background: bool, wait: bool = True, after: Sequence[Any] = ()) -> QueuedCopy | None:
        """Run `chunk(buffer, start, end)` over `n` pages on `direction`'s stream (copy_stream.py)."""
        buffer = direction.buffer
        return direction.copies.run(n, self.chunk_pages, lambda start, end: chunk(buffer, start, end), background,
                                    wait, after=after)

    def _streams_ready(self) -> tuple[_Direction, _Direction]:
        """(loads, demotions), each made on first use."""
        if self._loads is None or self._demotions is None:
            self._loads, self._demotions = (_Direction(self.pool, self.chunk_pages) for _ in range(2))
        return self._loads, self._demotions


class _Direction:
    """One direction's copy stream and chunk buffer."""

    def __init__(self, pool: PagePool, chunk_pages: int) -> None:
        with torch.inference_mode(False):
            self.buffer = torch.empty(pool.spec.staging_shape(chunk_pages), dtype=pool.kv.dtype, device=pool.device)
        self.copies = CopyStream(pool.device)

    def mark(self) -> list[Any]:
        """An event where this direction's stream has got to (none on the CPU: copies ran already)."""
        return [self.copies.stream.record_event()] if self.copies.cuda else []

def _as_index(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)

