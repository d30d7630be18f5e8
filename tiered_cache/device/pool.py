"""`PagePool`: one preallocated tensor of KV pages on a torch device, and its free list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiered_cache.device.allocator import PageAllocator, as_page_array
from tiered_cache.device.pool_ops import PageOps, select_ops
from tiered_cache.errors import KVShapeError, PageStateError
from tiered_cache.model.spec import KVSpec, Layout
from tiered_cache.model.units import parse_size


@dataclass(frozen=True)
class PoolUsage:
    total_pages: int
    free_pages: int
    used_pages: int
    page_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    @property
    def utilisation(self) -> float:
        return self.used_pages / self.total_pages


class PagePool:
    """Pages of KV in the layer-first layout of DESIGN.md §6, with allocate/free and data movement.

    `kv[0, layer]` / `kv[1, layer]` are plain views of one layer's K / V pages, which is what an
    attention kernel reads. The tensor is allocated and zero-filled once, so its memory is touched
    before the first request needs it.
    """

    def __init__(self, spec: KVSpec, num_pages: int, device: str | torch.device = "cpu",
                 ops: str | None = None) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages)
        self.kv = torch.zeros(spec.pool_shape(num_pages), dtype=spec.dtype.torch, device=self.device)
        self.ops: PageOps = select_ops(self.device, ops)

    @classmethod
    def with_capacity(cls, spec: KVSpec, capacity: str | int, device: str | torch.device = "cpu",
                      ops: str | None = None) -> PagePool:
        """A pool of as many whole pages as fit in `capacity` bytes (e.g. `"2GiB"`)."""
        num_pages = parse_size(capacity) // spec.bytes_per_page
        if num_pages <= 0:
            raise ValueError(f"capacity {capacity!r} holds no page of {spec.bytes_per_page:,} bytes")
        return cls(spec, num_pages, device, ops)

    # --- allocation --------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def can_allocate(self, n: int) -> bool:
        return self.allocator.can_allocate(n)

    def allocate(self, n: int) -> np.ndarray:
        """`n` free page indices (int64). Raises PoolExhaustedError, allocating nothing, if fewer are free."""
        return self.allocator.allocate(n)

    def free(self, pages: Any) -> None:
        """Give pages back. Raises PageStateError, freeing nothing, on a double free or bad index."""
        self.allocator.free(pages)

    def pin(self, pages: Any) -> None:
        """Keep allocated pages from reuse until `unpin`, even if freed meanwhile (a copy is in flight)."""
        self.allocator.pin(pages)

    def unpin(self, pages: Any) -> None:
        """Undo one `pin`; a page freed while pinned becomes free with its last unpin."""
        self.allocator.unpin(pages)

    def usage(self) -> PoolUsage:
        a = self.allocator
        return PoolUsage(a.num_pages, a.num_free, a.num_used, self.spec.bytes_per_page)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()

    def slots(self, pages: Any, num_tokens: int) -> np.ndarray:
        """Flat slot indices for the first `num_tokens` tokens laid out over `pages` in order."""
        arr = as_page_array(pages, self.num_pages)
        ps = self.spec.page_size
        if num_tokens > arr.size * ps:
            raise PageStateError(f"{num_tokens} tokens do not fit in {arr.size} pages of {ps} tokens")
        return (arr[:, None] * ps + np.arange(ps)).reshape(-1)[:num_tokens]

    # --- data movement ---------------------------------------------------------------------------
    def store(self, slots: Any, kv: torch.Tensor) -> None:
        """Write the K/V of new tokens, shape (layers, 2, n, kv_heads, head_dim), into `slots`.

        Every slot must lie in an allocated page and appear once. Raises KVShapeError or
        PageStateError before anything is written.
        """
        slot_arr = as_page_array(slots, self.num_pages * self.spec.page_size)
        if np.unique(slot_arr).size != slot_arr.size:
            raise PageStateError("store() got the same slot twice; each token needs its own slot")
        self._check_tensor("kv", kv, self.spec.kv_shape(slot_arr.size))
        self.allocator.require_allocated(np.unique(slot_arr // self.spec.page_size))
        if slot_arr.size:
            self.ops.store(self.kv, self.spec.layout, self.spec.page_size, self._index(slot_arr),
                           kv.to(self.device))

    def gather(self, pages: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy `pages` into one contiguous page-first staging tensor (`out`, or a new one on the
        pool's device) and return it. `out` may live on another device, e.g. pinned host memory."""
        arr = self._pages(pages)
        shape = self.spec.staging_shape(arr.size)
        if out is None:
            out = torch.empty(shape, dtype=self.kv.dtype, device=self.device)
        else:
            self._check_tensor("out", out, shape)
            if not out.is_contiguous():
                raise KVShapeError("gather() needs a contiguous `out` tensor")
        if arr.size:
            if out.device == self.device:
                self.ops.gather(self.kv, self._index(arr), out)
            else:
                staged = torch.empty(shape, dtype=self.kv.dtype, device=self.device)
                self.ops.gather(self.kv, self._index(arr), staged)
                out.copy_(staged)
        return out

    def scatter(self, pages: Any, staging: torch.Tensor) -> None:
        """Copy a page-first staging tensor into `pages` (allocated, each once): gather's reverse."""
        arr = self._pages(pages)
        self._check_tensor("staging", staging, self.spec.staging_shape(arr.size))
        if arr.size:
            self.ops.scatter(self.kv, self._index(arr), staging.to(self.device))

    def read_tokens(self, pages: Any, num_tokens: int) -> torch.Tensor:
        """KV of the first `num_tokens` tokens stored over `pages`, in tensor-API shape (a copy)."""
        slots = self._index(self.slots(pages, num_tokens))
        pages_t, offsets = slots // self.spec.page_size, slots % self.spec.page_size
        if self.spec.layout is Layout.NHD:
            return self.kv[:, :, pages_t, offsets].transpose(0, 1).contiguous()
        return self.kv[:, :, pages_t, :, offsets].permute(2, 1, 0, 3, 4).contiguous()

    # --- checks ------------------------------------------------------------------------------------
    def _pages(self, pages: Any) -> np.ndarray:
        arr = as_page_array(pages, self.num_pages)
        if np.unique(arr).size != arr.size:
            raise PageStateError("the same page appears twice; gather/scatter need distinct pages")
        self.allocator.require_allocated(arr)
        return arr

    def _index(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(arr).to(self.device)

    def _check_tensor(self, what: str, tensor: Any, shape: tuple[int, ...]) -> None:
        check_tensor(what, tensor, shape, self.kv.dtype, self.spec.model_id)


def check_tensor(what: str, tensor: Any, shape: tuple[int, ...], dtype: torch.dtype, model: str) -> None:
    """Raise KVShapeError unless `tensor` is a torch.Tensor of exactly `shape` and `dtype`."""
    if not isinstance(tensor, torch.Tensor):
        raise KVShapeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise KVShapeError(f"{what} has shape {tuple(tensor.shape)}, expected {shape} for {model}")
    if tensor.dtype != dtype:
        raise KVShapeError(f"{what} has dtype {tensor.dtype}, expected {dtype} (no silent casts)")
