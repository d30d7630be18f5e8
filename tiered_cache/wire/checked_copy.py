"""`copy_crc`: a page's bytes copied into their destination and checksummed in the same pass.

Raw pages from below (a same-host store's arena, a disk file in the page cache) are copied into
pool pages and their CRC-32C checked before use. The native version (`_checked_copy.c`, built
by `pip install` on x86-64 where a C compiler is at hand) reads each byte once, feeds the CPU's
crc32 instruction and writes with non-temporal stores: a memcpy's memory traffic for both jobs.
Without it (another CPU, no compiler): numpy's copy, then the checksum over the source, which
the copy just left in cache (`TIERED_CACHE_NATIVE=0` forces it). Both give the same CRC; their
speeds: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tiered_cache.wire.checksum import crc32c_extend

try:
    from tiered_cache.wire import _checked_copy as _native
except ImportError:  # not built here (no compiler, not x86-64): the two-pass version
    _native = None

# TIERED_CACHE_NATIVE=0 takes the two-pass version anyway (to compare the two, or to rule one out).
NATIVE = _native is not None and bool(_native.available()) and os.environ.get("TIERED_CACHE_NATIVE", "1") != "0"


def copy_crc_two_pass(src: Any, dest: np.ndarray, crc: int = 0) -> int:
    """`copy_crc` as two passes: numpy's copy, then the checksum of the source."""
    _numpy_copy(src, dest)
    return crc32c_extend(crc, src)


def copy_crc(src: Any, dest: np.ndarray, crc: int = 0) -> int:
    """Copy `src` (a contiguous buffer) into `dest` (uint8, of the same size, up to 3 dimensions
    with the last contiguous) in order, and return the CRC-32C of `src` continued from `crc`.
    They must not overlap."""
    if _takes_native(dest):
        return _native.copy_crc(src, dest, crc)
    return copy_crc_two_pass(src, dest, crc)


def copy_bytes(src: Any, dest: np.ndarray) -> None:
    """`copy_crc` for a caller that needs no checksum: the native copy (its checksum costs
    nothing beside the copy), else numpy's copy alone."""
    if _takes_native(dest):
        _native.copy_crc(src, dest, 0)
    else:
        _numpy_copy(src, dest)


def _numpy_copy(src: Any, dest: np.ndarray) -> None:
    flat = np.frombuffer(src, dtype=np.uint8)
    if flat.size != dest.size:
        raise ValueError(f"copy_crc: destination holds {dest.size} bytes, source {flat.size}")
    np.copyto(dest, flat.reshape(dest.shape))


def _takes_native(dest: np.ndarray) -> bool:
    return NATIVE and dest.ndim <= 3 and dest.dtype == np.uint8 and dest.strides[-1:] in ((1,), ())
