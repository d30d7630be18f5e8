"""Free list of page indices: O(1) Python operations per call, however many pages move at once."""

from __future__ import annotations

from typing import Any

import numpy as np

from tiered_cache.errors import IntegrityError, PageStateError, PoolExhaustedError


def as_page_array(pages: Any, num_pages: int) -> np.ndarray:
    """`pages` as a 1-D int64 numpy array, checked to lie in [0, num_pages). Raises PageStateError."""
    if hasattr(pages, "detach") and hasattr(pages, "cpu"):  # torch.Tensor
        pages = pages.detach().cpu().numpy()
    arr = np.asarray(pages)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise PageStateError(f"pages must be a flat sequence of integers, got {arr.dtype} with shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= num_pages:
        bad = low if low < 0 else high
        raise PageStateError(f"page index {bad} is out of range for a pool of {num_pages} pages")
    return arr


class PageAllocator:
    """Tracks which of `num_pages` pages are free.

    The free list is a stack in a preallocated array: `allocate(n)` takes the top n entries and
    `free(pages)` pushes them back, each a single vectorised slice. `in_use` mirrors the stack
    so double frees and frees of never-allocated pages are caught before any state changes.
    """

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        # Reversed so that allocation hands out low page numbers first (easier to read in tests).
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages  # entries [0, _top) of _stack are free
        self.in_use = np.zeros(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_pages - self._top

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self._top

    def allocate(self, n: int) -> np.ndarray:
        """Take `n` free pages. Raises PoolExhaustedError (changing nothing) when fewer are free."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"number of pages to allocate must be a non-negative integer, got {n!r}")
        if n > self._top:
            raise PoolExhaustedError(needed=int(n), available=self._top, total=self.num_pages)
        pages = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        self.in_use[pages] = True
        return pages

    def free(self, pages: Any) -> None:
        """Return pages to the free list. Raises PageStateError (changing nothing) for pages out of
        range, repeated within the call, or not currently allocated (double free)."""
        arr = as_page_array(pages, self.num_pages)
        if arr.size == 0:
            return
        if np.unique(arr).size != arr.size:
            raise PageStateError(f"the same page appears twice in one free() call: {arr.tolist()[:16]}")
        not_used = arr[~self.in_use[arr]]
        if not_used.size:
            raise PageStateError(f"double free or never allocated: pages {not_used.tolist()[:16]} are already free")
        self.in_use[arr] = False
        self._stack[self._top:self._top + arr.size] = arr[::-1]
        self._top += arr.size

    def require_allocated(self, pages: np.ndarray) -> None:
        """Raise PageStateError unless every page in `pages` is currently allocated."""
        free = pages[~self.in_use[pages]]
        if free.size:
            raise PageStateError(f"pages {np.unique(free).tolist()[:16]} are free; allocate them before use")

    def check_integrity(self) -> None:
        """free + used == total, and the free stack holds exactly the pages not in use."""
        free = self._stack[:self._top]
        if np.unique(free).size != free.size:
            raise IntegrityError("a page appears twice in the free list")
        if self.in_use[free].any():
            raise IntegrityError("a page is both free and in use")
        if free.size + int(self.in_use.sum()) != self.num_pages:
            raise IntegrityError(
                f"free ({free.size}) + used ({int(self.in_use.sum())}) != total ({self.num_pages})"
            )
