"""Reusable page-first host buffers for pages on their way between tiers.

Fresh memory costs first-touch page faults (far slower than a copy: docs/PERFORMANCE.md), so buffers are kept
and leased out again; on CUDA they are pinned so host <-> device copies can be asynchronous.
A buffer is leased by one load or demotion at a time and given back when its bytes are in place.
"""

from __future__ import annotations

import threading

import torch

from tiered_cache.device.memory import empty_cpu
from tiered_cache.device.pinned import pinned_empty
from tiered_cache.model.spec import KVSpec


class StagingBuffers:
    def __init__(self, spec: KVSpec, pin: bool | None = None, keep: int = 8) -> None:
        self.spec = spec
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.keep = keep  # free buffers kept for reuse; more are dropped
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def lease(self, num_pages: int) -> torch.Tensor:
        """A buffer of at least `num_pages` pages (page-first, the spec's dtype), all yours."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.shape[0] >= num_pages]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].shape[0]))
        # Never an inference tensor (a caller may be in inference mode): background threads,
        # which are not, write into these buffers too.
        shape = self.spec.staging_shape(max(num_pages, 1))
        with torch.inference_mode(False):
            if self.pin:
                return pinned_empty(shape, self.spec.dtype.torch)
            # Unpinned: on transparent huge pages where Linux gives them, which makes the first
            # touch of fresh memory several times faster (device/memory.py).
            return empty_cpu(shape, self.spec.dtype.torch)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.keep:
                smallest = min(range(len(self._free)), key=lambda i: self._free[i].shape[0])
                self._free.pop(smallest)
