"""Pinned host memory for large, long-lived buffers, pinned at the size asked for.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds
every allocation up to the next power of two and keeps a freed block cached for reuse: a 36 GiB
host tier would pin 64 GiB, and a tier that is closed leaves its memory pinned. Buffers from
`LARGE_BYTES` on are mapped here instead (anonymous memory, transparent huge pages asked for),
registered with CUDA at their own size, and unregistered, then unmapped, when the last tensor
viewing them is freed. Smaller ones stay with torch's allocator, whose rounding costs little there.
Where CUDA refuses the registration, torch's allocator is used after all (logged once).
"""

from __future__ import annotations

import logging
import math
import mmap
import sys
import threading
from collections.abc import Callable

import numpy as np
import torch

from tiered_cache.device.arena_registry import forget_cuda_error
from tiered_cache.shm.advice import MADV_HUGEPAGE, madvise, map_address

log = logging.getLogger(__name__)

LARGE_BYTES = 64 * 2**20
_PORTABLE = 0x01  # cudaHostRegisterPortable

Register = Callable[[int, int], int]  # (address, size) -> CUDA error, 0 when registered
Unregister = Callable[[int], int]  # address -> CUDA error


class RegisteredMapping:
    """`size` bytes of anonymous memory, registered (pinned) with `register` at construction and
    released by `unregister` then unmapped when collected. Exposes itself to numpy (and through it
    to torch) by `__array_interface__`, so every tensor viewing it keeps it alive."""

    def __init__(self, size: int, register: Register, unregister: Unregister) -> None:
        self._map: mmap.mmap | None = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.address, self.size, self._unregister = map_address(self._map), size, unregister
        self._registered = False
        madvise(self.address, size, MADV_HUGEPAGE)  # fewer pages for the driver to lock
        err = register(self.address, size)
        if err:
            self._unmap()
            raise PinRefused(err)
        self._registered = True
        self.__array_interface__ = {"data": (self.address, False), "shape": (size,), "typestr": "|u1",
                                    "version": 3}

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def __del__(self) -> None:
        # Unregistered first: the driver must let go of the pages before they are unmapped.
        if self._registered:
            self._registered = False
            err = self._unregister(self.address)
            if err and not sys.is_finalizing():  # at exit the runtime may have gone first
                log.warning("pinned host memory: unregistering %d bytes at %#x failed (CUDA error %d)",
                            self.size, self.address, err)
        self._unmap()


class PinRefused(RuntimeError):
    """CUDA would not register the memory (its error code in `args[0]`)."""


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, register: Register | None = None,
                 unregister: Unregister | None = None) -> torch.Tensor:
    """An uninitialised pinned CPU tensor of `shape` and `dtype`. From LARGE_BYTES on it pins
    exactly its own bytes (module doc); below, or where CUDA refuses, torch's `pin_memory`.
    `register`/`unregister` default to the CUDA runtime's cudaHostRegister/cudaHostUnregister."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < LARGE_BYTES:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    cuda_runtime = register is None or unregister is None
    if cuda_runtime:
        register, unregister = _cuda_calls()
    try:
        mapping = RegisteredMapping(nbytes, register, unregister)
    except PinRefused as refused:
        if cuda_runtime:
            forget_cuda_error(torch.cuda.current_device())  # else torch's next launch check raises it
        _log_refusal(nbytes, int(refused.args[0]))
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    raw = torch.from_numpy(np.asarray(mapping))  # the array's base is the mapping: kept alive with it
    return raw.view(dtype).view(shape)


_REFUSAL_LOGGED = threading.Event()


def _log_refusal(nbytes: int, err: int) -> None:
    if not _REFUSAL_LOGGED.is_set():
        _REFUSAL_LOGGED.set()
        log.warning("CUDA would not register %d bytes of host memory (error %d): pinning through torch's "
                    "allocator, which rounds each buffer up to a power of two", nbytes, err)


def _cuda_calls() -> tuple[Register, Unregister]:
    cudart = torch.cuda.cudart()
    # Portable: pinned for every device's context, as torch's own pinned memory is.
    return (lambda address, size: int(cudart.cudaHostRegister(address, size, _PORTABLE)),
            lambda address: int(cudart.cudaHostUnregister(address)))

