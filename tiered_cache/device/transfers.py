"""Asynchronous page transfers between the device pool and pinned host memory.

`offload(pages)` copies pages device -> pinned host on a separate CUDA stream that first waits
for the compute stream, so KV that the model is still writing is never copied half-written (the
barrier vLLM's CPU offload once missed). `load(host_pages, pages)` copies host -> device one
layer at a time with one CUDA event per layer, so an engine can start layer 0 while later
layers are still arriving. A pinned buffer belongs to its transfer until the caller releases
it, and is never handed out again while a copy into or out of it may be in flight.

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
    """Pages on their way to host memory. `wait()` returns them; `release()` gives the buffer back."""

    pages: np.ndarray
    host: torch.Tensor  # page-first, a view of a pinned buffer
    event: Any  # torch.cuda.Event recorded after the copy, or None on the CPU
    buffer: int
    owner: PinnedBuffers
    released: bool = False

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
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
    """A host -> device load in flight, one event per layer."""

    events: list[Any] = field(default_factory=list)  # torch.cuda.Event per layer, or None on the CPU
    keep_alive: list[torch.Tensor] = field(default_factory=list)  # sources of copies not yet proven done

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make `stream` (default: the current one) wait until `layer` is in the pool; the host does not block."""
        event = self.events[layer]
        if event is not None:
            (stream or torch.cuda.current_stream()).wait_event(event)

    def synchronize(self) -> None:
        for event in self.events:
            if event is not None:
                event.synchronize()
        self.keep_alive.clear()


class Transfers:
    """Offload and load-back for one `PagePool`."""

    def __init__(self, pool: PagePool, buffers: PinnedBuffers) -> None:
        self.pool = pool
        self.buffers = buffers
        self.cuda = pool.kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=pool.kv.device) if self.cuda else None

    def offload(self, pages: Any) -> OffloadTicket:
        arr = as_page_array(pages, self.pool.num_pages)
        if arr.size > self.buffers.pages_per_buffer:
            raise ValueError(f"{arr.size} pages do not fit a pinned buffer of {self.buffers.pages_per_buffer}")
        index = self.buffers.acquire()
        host = self.buffers.buffers[index][:arr.size]
        if not self.cuda:
            self.pool.gather(arr, out=host)
            return OffloadTicket(arr, host, None, index, self.buffers)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.pool.kv.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)  # everything the compute stream wrote so far lands first
            staged = self.pool.gather(arr)  # on the copy stream
            host.copy_(staged, non_blocking=True)
            staged.record_stream(self.stream)  # its memory is not reused before the copy finished
            done = torch.cuda.Event()
            done.record(self.stream)
        return OffloadTicket(arr, host, done, index, self.buffers)

    def load(self, host_pages: torch.Tensor, pages: Any) -> LayerLoad:
        """Copy page-first `host_pages` into `pages` of the pool, layer by layer."""
        arr = as_page_array(pages, self.pool.num_pages)
        self.pool.allocator.require_allocated(arr)
        expected = self.pool.spec.staging_shape(arr.size)
        if tuple(host_pages.shape) != expected or host_pages.dtype != self.pool.kv.dtype:
            raise ValueError(f"host pages must be {expected} {self.pool.kv.dtype}, "
                             f"got {tuple(host_pages.shape)} {host_pages.dtype}")
        index = torch.from_numpy(arr).to(self.pool.kv.device)
        load = LayerLoad()
        order = (1, 0, *range(2, host_pages.dim() - 1))  # (n, 2, *inner) -> (2, n, *inner), as the pool
        if not self.cuda:
            for layer in range(self.pool.spec.num_layers):
                self.pool.kv[:, layer].index_copy_(1, index, host_pages[:, layer].permute(order))
                load.events.append(None)
            return load
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.pool.kv.device))
        with torch.cuda.stream(self.stream):
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
