"""CRC-32C (Castagnoli) of any contiguous buffer, from the fastest implementation installed.

`crc32c` (the `fast` extra; LGPL-2.1) is the faster one, reads any buffer in place (ring
views, memoryviews) and releases the GIL from 32 KiB, so checks on several threads run in
parallel. `google-crc32c` (Apache-2.0, always installed) is the fallback: slower, and it
releases the GIL only for `bytes` of 1 MiB or more; other buffers go to it as numpy views (it
refuses memoryviews), read with the GIL held. Both compute the same CRC; their speeds:
docs/PERFORMANCE.md, "Checksums".
"""

from __future__ import annotations

import os
from typing import Any

import google_crc32c
import numpy as np

try:
    import crc32c as _fast
except ImportError:  # the `fast` extra is not installed
    _fast = None


def _google_extend(crc: int, part: Any) -> int:
    """CRC-32C of `part` (a contiguous buffer) continued from `crc`, by google-crc32c."""
    data = part if isinstance(part, bytes) else np.frombuffer(part, dtype=np.uint8)  # a view, never a copy
    return google_crc32c.extend(crc, data)


def _fast_extend(crc: int, part: Any) -> int:
    """CRC-32C of `part` (a contiguous buffer) continued from `crc`, by crc32c."""
    return _fast.crc32c(part, crc)


IMPLEMENTATIONS = {"google-crc32c": _google_extend}
if _fast is not None and _fast.hardware_based:  # its software fallback is slower than google's C one
    IMPLEMENTATIONS["crc32c"] = _fast_extend
IMPLEMENTATION = "crc32c" if "crc32c" in IMPLEMENTATIONS else "google-crc32c"
crc32c_extend = IMPLEMENTATIONS[IMPLEMENTATION]  # (crc, buffer) -> crc


def checker_threads(cores: int | None = None) -> int:
    """Threads that check (and copy) pages beside one transfer: half the cores this process may
    run on, 2 to 8. One thread checks 10-22 GB/s (CPU-dependent) and copies with a check at about
    half that, while a GPU node's host->device link carries ~55 GB/s: two threads would hold it
    back there; more than 8 would only take cores from the engine. `cores`: instead of counting."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(2, min(8, cores // 2))
