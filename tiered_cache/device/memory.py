"""Pre-touching fresh memory off the request path.

The first write to a fresh OS page costs a page fault and the kernel zeroing it, far slower than
a copy, so a pool and a host slab zero-filled at construction would take seconds.
`allocate_pretouched` returns at once and a daemon thread faults the pages in.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable
from typing import Any

import torch

from tiered_cache.device.pinned import pinned_empty
from tiered_cache.shm.advice import MADV_HUGEPAGE as _MADV_HUGEPAGE
from tiered_cache.shm.advice import madvise as _madvise
from tiered_cache.shm.advice import populate as _populate

# A pre-touch steps aside between chunks while a request runs, so a chunk bounds how long it can
# slow one: faulting in 64 MiB took 0.2-0.3 s on a busy VM (requests beside it 5-10x slower), 4 MiB
# a few milliseconds.
_CHUNK_BYTES = 4 * 2**20
_OS_PAGE = mmap.PAGESIZE
ZERO_FILL_BYTES = 2**20
HUGEPAGE_MIN_BYTES = 4 * 2**20
_HUGE_PAGE = 2 * 2**20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


class PretouchThread(threading.Thread):
    """A daemon thread that faults in every OS page of one contiguous CPU tensor, in chunks.

    Where Linux offers MADV_POPULATE_WRITE the kernel maps the pages without changing a byte, so
    the owner may write to the tensor meanwhile (`preserves_bytes` is True). Elsewhere the thread
    writes a zero into one byte per OS page, which would undo a concurrent write: the owner calls
    `before_write()` before its first write, which then waits for the thread.
    """

    def __init__(self, tensor: torch.Tensor, chunk_bytes: int = _CHUNK_BYTES, blocks: int = 1) -> None:
        """`blocks`: the tensor is that many equal blocks side by side, each holding a slice of
        every page (a layer-first pool: one block per K/V and layer); they are faulted in page
        range by page range across all blocks, so the pages handed out first (the allocator's
        lowest) are whole first, not only their first layer."""
        assert tensor.device.type == "cpu" and tensor.is_contiguous(), "pretouch needs a contiguous CPU tensor"
        super().__init__(name="tiered-cache-pretouch", daemon=True)
        self._bytes = tensor.reshape(-1).view(torch.uint8)  # keeps the memory alive until done
        self._chunk = max(_OS_PAGE, chunk_bytes // _OS_PAGE * _OS_PAGE)
        self._blocks = blocks if blocks > 1 and self._bytes.numel() % blocks == 0 else 1
        self.preserves_bytes = _populate(self._bytes.data_ptr(), min(self._bytes.numel(), _OS_PAGE))
        # Called between chunks (set by the owner: e.g. wait, briefly, while a request runs), so a
        # new cache's first requests do not share the cores and the memory bus with its pre-touch.
        # Only where the thread changes no byte: a request may then write meanwhile, never wait for it.
        self.yield_to: Callable[[], Any] | None = None

    def run(self) -> None:
        if self.preserves_bytes and self._blocks > 1:
            self._populate_across_blocks()
            return
        data, start, end = self._bytes, 0, self._bytes.numel()
        while start < end:
            stop = min(start + self._chunk, end)
            self._step_aside()
            if self.preserves_bytes:
                _populate(data.data_ptr() + start, stop - start)  # a refusal leaves faults to first use
            else:
                data[start:stop:_OS_PAGE].zero_()  # one byte in each OS page of the chunk ...
                data[stop - 1:stop].zero_()  # ... and in the page the chunk ends in
            start = stop

    def _populate_across_blocks(self) -> None:
        """Fault in the same range of every block, one range (a chunk's share) after the other."""
        block = self._bytes.numel() // self._blocks
        step = max(_OS_PAGE, self._chunk // self._blocks // _OS_PAGE * _OS_PAGE)
        base = self._bytes.data_ptr()
        for start in range(0, block, step):
            length = min(step, block - start)
            for b in range(self._blocks):
                address = base + b * block + start
                # Before each block's range that reaches a huge page not touched yet: it faults in
                # a whole one, so a step across all blocks would be blocks x 2 MiB, not a chunk;
                # the ranges within a touched huge page cost next to nothing.
                if (address + length - 1) // _HUGE_PAGE != (address - 1) // _HUGE_PAGE:
                    self._step_aside()
                _populate(address, length)

    def _step_aside(self) -> None:
        yield_to = self.yield_to
        if yield_to is not None:
            yield_to()

    def before_write(self) -> None:
        """Wait for the thread if it writes zeros; return at once if it changes no byte."""
        if not self.preserves_bytes and self.is_alive():
            self.join()


def allocate_pretouched(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu",
                        pin_memory: bool = False, blocks: int = 1) -> tuple[torch.Tensor, PretouchThread | None]:
    """A new tensor for a long-lived pool, and the thread pre-touching it (None when there is none).

    Large unpinned CPU tensors are left uninitialised and pre-touched by a daemon thread, so this
    returns at once. Pinned memory is faulted in by pinning, at its own size (`pinned.py`). Small CPU tensors (up to
    `ZERO_FILL_BYTES`) and tensors on an accelerator are zero-filled at once, which costs next to
    nothing there. Callers must not rely on the bytes of a large CPU tensor before writing them.
    `blocks`: see `PretouchThread`.
    """
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if pin_memory:
        return pinned_empty(shape, dtype), None
    if device.type != "cpu" or nbytes <= ZERO_FILL_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device), None
    tensor = empty_cpu(shape, dtype)
    return tensor, pretouch_async(tensor, blocks)


def empty_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty` on the CPU; from HUGEPAGE_MIN_BYTES on, Linux is asked for transparent huge
    pages (MADV_HUGEPAGE, best effort): one fault per 2 MiB instead of per 4 KiB makes the first
    touch of fresh memory several times faster (docs/PERFORMANCE.md)."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes >= HUGEPAGE_MIN_BYTES:
        _madvise(tensor.data_ptr(), nbytes, _MADV_HUGEPAGE)
    return tensor


def pretouch_async(tensor: torch.Tensor, blocks: int = 1) -> PretouchThread:
    """Start faulting in `tensor`'s memory on a daemon thread and return the thread (started)."""
    thread = PretouchThread(tensor, blocks=blocks)
    thread.start()
    return thread
