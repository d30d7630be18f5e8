"""`ReadBuffers`: reused page-sized buffers that page files are read through (disk_files.py).

A read into a CPU pool goes through a buffer (a page's blocks are strided there), then one
checked copy into place. A buffer made on a request's path costs a page of fresh memory faulted
in; kept and reused it stays in cache. Any thread takes one (the tier's reader threads, a
prefetch thread or a request's thread reading a small call itself), so the buffers are made
ahead (`make`, from the tier's warm-up) for whoever reads first, not per thread on its first read.
The last one given back is the next taken: the buffer most likely still in cache.
"""

from __future__ import annotations

import threading


class ReadBuffers:
    """At most `keep` buffers kept between reads; more are made while more threads read at once."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.made = 0  # buffers made since start: one per reader at most once warm
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def make(self, count: int, nbytes: int) -> None:
        """Have `count` buffers of at least `nbytes` ready (fewer than `keep`)."""
        with self._lock:
            self._free = [b for b in self._free if len(b) >= nbytes]
            missing = min(count, self.keep) - len(self._free)
        fresh = [self._new(nbytes) for _ in range(max(0, missing))]
        with self._lock:
            self._free = fresh + self._free  # the warm ones last: taken first

    def take(self, nbytes: int) -> memoryview:
        """A buffer of at least `nbytes`: a kept one, else a new one. Give it back after."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if len(self._free[i]) >= nbytes:
                    return self._free.pop(i)
        return self._new(nbytes)

    def give_back(self, buffer: memoryview) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buffer)

    def _new(self, nbytes: int) -> memoryview:
        self.made += 1
        return memoryview(bytearray(nbytes))  # zeroed, so faulted in here
