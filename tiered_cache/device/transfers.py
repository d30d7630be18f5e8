"""Asynchronous page transfers between the device pool and pinned host memory.

`offload(pages)` copies pages device -> pinned host on a separate CUDA stream that first waits
for the compute stream, so KV that the model is still writing is never copied half-written (the
barrier vLLM's CPU offload once missed). `load(host_pages, pages)` copies host -> device one
layer at a time with one CUDA event per layer, so an engine can start layer 0 while later
layers are still arriving. A pinned buffer belongs to its transfer until the caller releases
it, and is never handed out again while a copy into or out of it may be in flight.

The pool pages a transfer reads or writes are pinned in the allocator until the transfer is known
complete (`OffloadTicket.wait()`/`release()`, `LayerLoad.synchronize()`): a caller may free them
meanwhile, but they are not reallocated, so no new request writes them under the copy.

On the CPU the same calls run synchronously (events are None), so engines and tests use one API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiered_cache.device.allocator import as_page_array
from tiered_cache.device.pool import PagePool
from tiered_cache.errors import TieredCacheError


class NoFreeBufferError(TieredCacheError):
    """Every pinned staging buffer is held by a transfer: release one (or make more) first."""


class PinnedBuffers:
    """A fixed set of page-first host buffers of `pages_per_buffer` pages each, allocated and
    touched once, pinned when CUDA is present."""

    def __init__(self, pool: PagePool, pages_per_buffer: int, num_buffers: int = 4, pin: bool | None = None) -> None:
        pin = torch.cuda.is_available() if pin is None else pin
        shape = pool.spec.staging_shape(pages_per_buffer)
        self.pages_per_buffer = pages_per_buffer
        self.buffers = [torch.zeros(shape, dtype=pool.kv.dtype, pin_memory=pin) for _ in range(num_buffers)]
        self.free = list(range(num_buffers))

    def acquire(self) -> int:
        if not self.free:
            raise NoFreeBufferError(f"all {len(self.buffers)} pinned buffers are in use; release a transfer first")
        return self.free.pop()

    def release(self, index: int) -> None:
        if index in self.free:
            raise ValueError(f"pinned buffer {index} released twice")
        self.free.append(index)


@dataclass
class OffloadTicket:
    """Pages on their way to host memory. `wait()` returns them and unpins the pool pages;
    `release()` also gives the buffer back. Until one of them, the pages stay pinned."""

    pages: np.ndarray
    host: torch.Tensor  # page-first, a view of a pinned buffer
    event: Any  # torch.cuda.Event recorded after the copy, or None on the CPU
    buffer: int
    owner: PinnedBuffers
    pool: PagePool  # holds a pin on `pages` until the copy is known complete
    released: bool = False
    pinned: bool = True

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        """Block until the copy has finished, unpin the pages and return the host copy."""
        if self.event is not None:
            self.event.synchronize()
        if self.pinned:
            self.pinned = False
            self.pool.unpin(self.pages)
        return self.host

    def release(self) -> None:
        """Give the buffer back once the copy has finished (waits for it if needed)."""
        if self.released:
            raise ValueError("offload ticket released twice")
        self.wait()
        self.released = True
        self.owner.release(self.buffer)


@dataclass
class LayerLoad:
    """A host -> device load in flight, one event per layer. Its pool pages stay pinned until
    `synchronize()`, which every load needs once (on the CPU too, where the copy is done at once)."""

    pool: PagePool
    pages: np.ndarray  # destination pages, pinned until synchronize()
    events: list[Any] = field(default_factory=list)  # torch.cuda.Event per layer, or None on the CPU
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # sources of copies not yet proven done
    pinned: bool = True

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make `stream` (default: the current one) wait until `layer` is in the pool; the host does not block."""
        event = self.events[layer]
        if event is not None:
            (stream or torch.cuda.current_stream()).wait_event(event)

    def synchronize(self) -> None:
        """Block until every layer is in the pool, then drop the sources and unpin the pages."""
        for event in self.events:
            if event is not None:
                event.synchronize()
        self.keep_alive.clear()
        if self.pinned:
            self.pinned = False
            self.pool.unpin(self.pages)


class Transfers:
    """Offload and load-back for one `PagePool`."""

    def __init__(self, pool: PagePool, buffers: PinnedBuffers) -> None:
        self.pool = pool
        self.buffers = buffers
        self.cuda = pool.kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=pool.kv.device) if self.cuda else None

    def offload(self, pages: Any) -> OffloadTicket:
        """Start copying allocated `pages` (distinct) to a pinned buffer. The pages stay pinned, so
        freeing them does not let them be reallocated, until the ticket's `wait()` or `release()`.
        Raises ValueError if they do not fit a buffer, PageStateError for bad pages and
        NoFreeBufferError when every buffer is held; nothing stays pinned or acquired then."""
        arr = as_page_array(pages, self.pool.num_pages)
        if arr.size > self.buffers.pages_per_buffer:
            raise ValueError(f"{arr.size} pages do not fit a pinned buffer of {self.buffers.pages_per_buffer}")
        self.pool.pin(arr)
        buffer = None
        try:
            buffer = self.buffers.acquire()
            host = self.buffers.buffers[buffer][:arr.size]
            done = self._copy_out(arr, host)
        except BaseException:
            if buffer is not None:
                self.buffers.release(buffer)
            self.pool.unpin(arr)
            raise
        return OffloadTicket(arr, host, done, buffer, self.buffers, self.pool)

    def _copy_out(self, arr: np.ndarray, host: torch.Tensor) -> Any:
        """Gather `arr` into `host`; on CUDA, on the copy stream, returning the event that ends it."""
        if not self.cuda:
            self.pool.gather(arr, out=host)
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.pool.kv.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)  # everything the compute stream wrote so far completes first
            # NOTE: gather allocates its index and staging tensors while the copy stream is current,
            # so the caching allocator ties their memory to this stream: once freed, only later
            # work on this same stream can reuse it. record_stream says so explicitly for staged.
            staged = self.pool.gather(arr)
            host.copy_(staged, non_blocking=True)
            staged.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def load(self, host_pages: torch.Tensor, pages: Any) -> LayerLoad:
        """Copy page-first `host_pages` into allocated `pages` of the pool, layer by layer.

        The pages stay pinned (freeing them does not let them be reallocated) until the returned
        load's `synchronize()`. Raises ValueError for a wrong shape or dtype and PageStateError
        for pages that are not allocated, pinning nothing.
        """
        arr = as_page_array(pages, self.pool.num_pages)
        self.pool.allocator.require_allocated(arr)
        expected = self.pool.spec.staging_shape(arr.size)
        if tuple(host_pages.shape) != expected or host_pages.dtype != self.pool.kv.dtype:
            raise ValueError(f"host pages must be {expected} {self.pool.kv.dtype}, "
                             f"got {tuple(host_pages.shape)} {host_pages.dtype}")
        self.pool.pin(arr)
        load = LayerLoad(self.pool, arr)
        order = (1, 0, *range(2, host_pages.dim() - 1))  # (n, 2, *inner) -> (2, n, *inner), as the pool
        if not self.cuda:
            index = torch.from_numpy(arr).to(self.pool.kv.device)
            for layer in range(self.pool.spec.num_layers):
                self.pool.kv[:, layer].index_copy_(1, index, host_pages[:, layer].permute(order))
                load.events.append(None)
            return load
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.pool.kv.device))
        with torch.cuda.stream(self.stream):
            # Allocated (before the wait, so the host does not block on compute) while the copy
            # stream is current: its memory belongs to this stream, so freeing `index` when this
            # call returns cannot hand it to the compute stream before the copies below read it.
            index = torch.from_numpy(arr).to(self.pool.kv.device)
            index.record_stream(self.stream)
            self.stream.wait_event(ready)  # do not overwrite pages the compute stream still reads
            for layer in range(self.pool.spec.num_layers):
                device_layer = host_pages[:, layer].to(self.pool.kv.device, non_blocking=True)
                self.pool.kv[:, layer].index_copy_(1, index, device_layer.permute(order))
                device_layer.record_stream(self.stream)
                event = torch.cuda.Event()
                event.record(self.stream)
                load.events.append(event)
        load.keep_alive.append(host_pages)
        return load
