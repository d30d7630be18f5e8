"""glibc malloc settings for a process that moves many large buffers (page blobs of ~1 MiB).

By default glibc serves such buffers with fresh mmap()s or trims freed heap back to the OS, so
every batch of blobs pays first-touch page faults: reading files into fresh memory runs several
times slower than into freed memory kept for reuse (docs/PERFORMANCE.md, "Tiers: host RAM, disk,
Redis"). Applied by the
`tiered-cache` commands, by `TieredCache` and by the vLLM connector's block store (config
`malloc_tuning`), and by the benches for their baselines; never at import. Beside memory.py,
which pre-touches the large buffers this process allocates itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied = False


def tune_malloc(trim_threshold: int = 1 << 30, mmap_threshold: int = 32 << 20) -> bool:
    """Keep up to `trim_threshold` bytes of freed heap, and serve allocations below
    `mmap_threshold` from the heap. Returns False where this is not glibc (nothing changes)."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _applied = bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold)) and bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
    return _applied
