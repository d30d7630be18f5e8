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


def has_duplicates(arr: np.ndarray) -> bool:
    """Whether a 1-D integer array holds a value twice. A sort and one comparison: numpy 2's
    hash-based `np.unique` costs far more, on the request path of every copy (docs/PERFORMANCE.md,
    "The GPU path on an H100")."""
    if arr.size < 2:
        return False
    ordered = np.sort(arr)
    return bool((ordered[1:] == ordered[:-1]).any())


class PageAllocator:
    """Tracks which of `num_pages` pages are free, who shares them, and which are pinned by a
    transfer in flight.

    The free list is a stack in a preallocated array: `allocate(n)` takes the top n entries and
    `free(pages)` pushes them back, each a single vectorised slice. `refs` counts the holders of
    each page (copy-on-write forks share pages: `share` adds a holder, `free` removes one); a page
    with a holder is in use, so double frees and frees of never-allocated pages are caught before
    any state changes.

    A page is in exactly one state:
      free     on the stack, `in_use` False, no holder, no pins; `allocate` may hand it out.
      used     `in_use` True, refs >= 1 (pinned or not); its holders own it.
      pending  its last holder freed it while pinned: `in_use` False, pins > 0, not on the stack.
               A copy may still read or write it, so it reaches the stack with its last `unpin`.
    """

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.num_pages = num_pages
        # Reversed so that allocation hands out low page numbers first (easier to read in tests).
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages  # entries [0, _top) of _stack are free
        self.refs = np.zeros(num_pages, dtype=np.int64)  # holders of each page (forks share pages)
        self._pins = np.zeros(num_pages, dtype=np.int64)
        self._num_pending = 0

    @property
    def in_use(self) -> np.ndarray:
        """Per page, whether it has a holder (allocated, not yet freed by all who share it)."""
        return self.refs > 0

    @property
    def num_pending(self) -> int:
        """Pages freed while pinned: neither the caller's nor free until their last `unpin`."""
        return self._num_pending

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        """Pages not free: allocated ones and pending ones."""
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
        self.refs[pages] = 1
        return pages

    def share(self, pages: Any) -> None:
        """Add a holder to each of `pages` (allocated): a fork now holds them too, and they stay
        allocated until every holder has freed them. Raises PageStateError (changing nothing)
        unless every page is allocated; a page listed twice gains two holders."""
        arr = as_page_array(pages, self.num_pages)
        self.require_allocated(arr)
        np.add.at(self.refs, arr, 1)

    def is_shared(self, pages: Any) -> np.ndarray:
        """Per page of `pages`, whether more than one holder has it (a write must copy it first)."""
        return self.refs[as_page_array(pages, self.num_pages)] > 1

    def free(self, pages: Any) -> None:
        """Drop one holder of each of `pages`; a page whose last holder goes is released. Unpinned
        pages return to the free list now; pinned ones become pending and return with their last
        `unpin`. Raises PageStateError (changing nothing) for pages out of range, repeated within
        the call, or not currently allocated (double free, pending too)."""
        arr = as_page_array(pages, self.num_pages)
        if arr.size == 0:
            return
        if has_duplicates(arr):
            raise PageStateError(f"the same page appears twice in one free() call: {arr.tolist()[:16]}")
        not_used = arr[self.refs[arr] == 0]
        if not_used.size:
            raise PageStateError(f"double free or never allocated: pages {not_used.tolist()[:16]} are already free")
        self.refs[arr] -= 1
        arr = arr[self.refs[arr] == 0]  # pages other holders still share stay allocated
        pinned = self._pins[arr] > 0
        self._num_pending += int(pinned.sum())
        self._push(arr[~pinned])

    def pin(self, pages: Any) -> None:
        """Keep allocated `pages` out of the free list until a matching `unpin`, even if they are
        freed meanwhile: a transfer reading or writing them pins them. Pins count, so a page may be
        pinned more than once (also within one call). Raises PageStateError (changing nothing)
        unless every page is allocated."""
        arr = as_page_array(pages, self.num_pages)
        self.require_allocated(arr)
        np.add.at(self._pins, arr, 1)

    def unpin(self, pages: Any) -> None:
        """Undo one `pin` of each of `pages`; a pending page whose last pin goes is free again.
        Raises PageStateError (changing nothing) for a page with fewer pins than this call removes."""
        arr = as_page_array(pages, self.num_pages)
        if arr.size == 0:
            return
        unique, counts = np.unique(arr, return_counts=True)
        short = unique[self._pins[unique] < counts]
        if short.size:
            raise PageStateError(f"unpin() without a matching pin() on pages {short.tolist()[:16]}")
        self._pins[unique] -= counts
        released = unique[(self._pins[unique] == 0) & (self.refs[unique] == 0)]
        self._num_pending -= released.size
        self._push(released)

    def _push(self, arr: np.ndarray) -> None:
        self._stack[self._top:self._top + arr.size] = arr[::-1]
        self._top += arr.size

    def require_allocated(self, pages: np.ndarray) -> None:
        """Raise PageStateError unless every page in `pages` is currently allocated."""
        free = pages[self.refs[pages] == 0]
        if free.size:
            raise PageStateError(f"pages {np.unique(free).tolist()[:16]} are free; allocate them before use")

    def check_integrity(self) -> None:
        """free + used + pending == total; the free stack holds exactly the pages neither in use
        nor pinned; pin and holder counts are never negative."""
        free = self._stack[:self._top]
        if np.unique(free).size != free.size:
            raise IntegrityError("a page appears twice in the free list")
        if (self.refs[free] > 0).any():
            raise IntegrityError("a page is both free and in use")
        if (self.refs < 0).any():
            raise IntegrityError(f"negative holder counts on pages {np.flatnonzero(self.refs < 0).tolist()[:16]}")
        if (self._pins < 0).any():
            raise IntegrityError(f"negative pin counts on pages {np.flatnonzero(self._pins < 0).tolist()[:16]}")
        if (self._pins[free] > 0).any():
            raise IntegrityError("a pinned page is in the free list")
        used = int((self.refs > 0).sum())
        pending = int(((self._pins > 0) & (self.refs == 0)).sum())
        if pending != self._num_pending:
            raise IntegrityError(f"counted {pending} pending pages, recorded {self._num_pending}")
        if free.size + used + pending != self.num_pages:
            raise IntegrityError(
                f"free ({free.size}) + used ({used}) + pending ({pending}) != total ({self.num_pages})"
            )
