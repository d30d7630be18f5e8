"""`PagePool`: one preallocated tensor of KV pages on a torch device, and its free list."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiered_cache.device.allocator import PageAllocator, as_page_array, has_duplicates
from tiered_cache.device.memory import allocate_pretouched, empty_cpu
from tiered_cache.device.pool_ops import PageOps, select_ops
from tiered_cache.errors import KVShapeError, PageStateError
from tiered_cache.model.spec import KVSpec, Layout
from tiered_cache.model.units import parse_size

log = logging.getLogger("tiered_cache.device.pool")


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
    attention kernel reads. The tensor is allocated once; a large CPU pool is left uninitialised
    and a daemon thread (`pretouch`) faults its memory in off the request path (small and device
    pools are zero-filled: `allocate_pretouched`). Only pages a caller wrote are read as KV (the
    cache commits a page after storing it), so no unwritten byte reaches a caller who did not
    ask for those pages.
    """

    def __init__(self, spec: KVSpec, num_pages: int, device: str | torch.device = "cpu",
                 ops: str | None = None) -> None:
        self.spec = spec
        wanted = usable_device(device)
        self.ops: PageOps = select_ops(wanted, ops)
        self.allocator = PageAllocator(num_pages)
        # Faulted in page range by page range across its K/V and layer blocks: the pages the first
        # loads get are whole first.
        shape = spec.pool_shape(num_pages)
        self.kv, self.pretouch = allocate_pretouched(shape, spec.dtype.torch, wanted, blocks=shape[0] * shape[1])
        # The device the pool really lives on: "cuda" becomes "cuda:0", so `out.device == self.device`
        # holds for a tensor on the same GPU (a bare "cuda" compared unequal and doubled every gather).
        self.device = self.kv.device
        warm_up = getattr(self.ops, "warm_up", None)
        if warm_up is not None:
            try:
                warm_up()  # kernels compiled now, not on the first request that needs one
            except Exception as exc:
                if ops is not None:  # asked for by name: say so rather than run something else
                    raise
                # Picked because CuPy imported, but it cannot compile here (no NVRTC, a CuPy built
                # for another CUDA): torch's ops write the same bytes, somewhat slower.
                log.warning("the CUDA page kernels did not compile (%s: %s); using torch's page ops",
                            type(exc).__name__, exc)
                self.ops = select_ops(self.device, "torch")

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
        if self.pretouch is not None:
            self.pretouch.before_write()  # every write goes to allocated pages
        return self.allocator.allocate(n)

    def free(self, pages: Any) -> None:
        """Give pages back. Raises PageStateError, freeing nothing, on a double free or bad index."""
        self.allocator.free(pages)

    def share(self, pages: Any) -> None:
        """Add a holder to each of `pages` (a copy-on-write fork): each is freed with its last holder."""
        self.allocator.share(pages)

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
    def write(self, slots: Any, kv: torch.Tensor) -> None:
        """Write the K/V of new tokens, shape (layers, 2, n, kv_heads, head_dim), into `slots`.

        Every slot must lie in an allocated page and appear once. Raises KVShapeError or
        PageStateError before anything is written. `kv` may live on another device (it is copied).
        Slots that fill pages in order (what `slots()` returns) move at memcpy speed with the torch
        ops: one copy per run of consecutive pages; other slots go through `ops.write`.
        """
        slot_arr = as_page_array(slots, self.num_pages * self.spec.page_size)
        if has_duplicates(slot_arr):
            raise PageStateError("write() got the same slot twice; each token needs its own slot")
        self._check_tensor("kv", kv, self.spec.kv_shape(slot_arr.size))
        self.allocator.require_allocated(slot_arr // self.spec.page_size)
        if not slot_arr.size:
            return
        heads = _page_heads(slot_arr, self.spec.page_size) if self.ops.name == "torch" else None
        if heads is None:
            self.ops.write(self.kv, self.spec.layout, self.spec.page_size, self._index(slot_arr),
                           kv.to(self.device))
        else:
            self._move(heads, kv.transpose(0, 1), to_pool=True)

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
            if out.device == self.device and self._page_runs(arr):
                self._move_pages(arr, out, to_pool=False)
            elif out.device == self.device:
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
        if arr.size and staging.device == self.device and self._page_runs(arr):
            self._move_pages(arr, staging, to_pool=True)
        elif arr.size:
            self.ops.scatter(self.kv, self._index(arr), staging.to(self.device))

    def scatter_rows(self, pages: Any, source: torch.Tensor, rows: Any) -> None:
        """Copy rows `rows` of a page-first `source` (e.g. host RAM's slab) into `pages`, one copy:
        runs where both the rows and the pages are consecutive move as views, without the
        gathered intermediate `scatter(pages, source[rows])` would make."""
        arr, src = self._pages(pages), np.asarray(rows, dtype=np.int64)
        if arr.size != src.size:
            raise PageStateError(f"{arr.size} pages for {src.size} source rows")
        if not arr.size:
            return
        both = np.r_[0, np.flatnonzero((np.diff(arr) != 1) | (np.diff(src) != 1)) + 1]
        if len(both) > _MAX_RUN_COPIES:  # too fragmented: one indexed gather, then one scatter
            self.scatter(arr, source[torch.from_numpy(src)])
            return
        for start, end in zip(both, np.r_[both[1:], arr.size], strict=True):
            self.scatter(arr[start:end], source[int(src[start]):int(src[start]) + int(end - start)])

    def _page_runs(self, pages: np.ndarray) -> bool:
        """Whether whole-page moves should copy runs of consecutive pages (torch ops, few runs)
        rather than go through the ops' indexed gather/scatter."""
        return self.ops.name == "torch" and _count_runs(pages) <= _MAX_RUN_COPIES

    def _move_pages(self, pages: np.ndarray, staging: torch.Tensor, to_pool: bool) -> None:
        """Page-first `staging` (n, layers, 2, *inner) <-> `pages` of the pool, one strided copy
        per run of consecutive pages: (2, layers, count, *inner) on both sides."""
        order = (2, 1, 0, *range(3, staging.dim()))
        for i, page, count in consecutive_runs(pages):
            _copy(self.kv[:, :, page:page + count], staging[i:i + count].permute(order), to_pool)

    def copy_pages(self, src: Any, dst: Any) -> None:
        """Copy pool page `src[i]` into pool page `dst[i]` (all allocated and distinct): the copy a
        copy-on-write fork makes before writing into a shared page. One kernel on CUDA."""
        s, d = self._pages(src), self._pages(dst)
        if s.size != d.size:
            raise PageStateError(f"{s.size} source pages for {d.size} destination pages")
        if has_duplicates(np.concatenate([s, d])):
            raise PageStateError("copy_pages() needs distinct source and destination pages")
        if s.size:
            self.ops.copy(self.kv, self._index(s), self._index(d))

    def read_tokens(self, pages: Any, num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """KV of the first `num_tokens` tokens stored over `pages`, in tensor-API shape
        (layers, 2, num_tokens, kv_heads, head_dim): copied into `out` (any device and strides,
        so a caller can reuse memory) or into a new tensor on the pool's device, and returned.

        Returns whatever those pages hold: pass pages you wrote. Raises PageStateError for
        pages out of range or too few for `num_tokens`, KVShapeError for a wrong `out`.
        """
        arr = as_page_array(pages, self.num_pages)
        ps = self.spec.page_size
        if not 0 <= num_tokens <= arr.size * ps:
            raise PageStateError(f"{num_tokens} tokens do not fit in {arr.size} pages of {ps} tokens")
        shape = self.spec.kv_shape(num_tokens)
        if out is None:
            out = (empty_cpu(shape, self.kv.dtype) if self.device.type == "cpu"
                   else torch.empty(shape, dtype=self.kv.dtype, device=self.device))
        else:
            self._check_tensor("out", out, shape)
        if num_tokens:
            self._move(arr[:self.spec.pages_for_tokens(num_tokens)], out.transpose(0, 1), to_pool=False)
        return out

    def read_slots(self, slots: Any) -> torch.Tensor:
        """A copy of the K/V of the tokens at flat `slots` (any order, e.g. a sequence's live tokens
        after a retention policy dropped some), in tensor-API shape (layers, 2, n, heads, dim)."""
        arr = as_page_array(slots, self.num_pages * self.spec.page_size)
        ps = self.spec.page_size
        pages, offsets = self._index(arr // ps), self._index(arr % ps)
        if self.spec.layout is Layout.NHD:
            return self.kv[:, :, pages, offsets].transpose(0, 1)
        return self.kv[:, :, pages, :, offsets].permute(2, 1, 0, 3, 4)  # indices split by a slice lead: (n, 2, L, H, D)

    # --- token copies --------------------------------------------------------------------------------
    # Token i of a (2, layers, n, heads, dim) view lives in page heads[i // ps] at offset i % ps.
    # A run of consecutive pages is one strided copy over K/V and every layer (memcpy speed in
    # NHD); more runs than _MAX_RUN_COPIES go through one index op per call or per (K/V, layer).
    def _move(self, heads: np.ndarray, tokens: torch.Tensor, to_pool: bool) -> None:
        ps = self.spec.page_size
        full, rem = divmod(tokens.shape[2], ps)
        whole = tokens[:, :, :full * ps].unflatten(2, (full, ps))  # (2, L, pages, ps, H, D)
        if _count_runs(heads[:full]) <= _MAX_RUN_COPIES:
            for i, page, count in consecutive_runs(heads[:full]):
                _copy(self._page_view(page, count), whole[:, :, i:i + count], to_pool)
        else:
            self._move_indexed(heads[:full], whole, to_pool)
        if rem:
            _copy(self._page_view(int(heads[full]), 1)[:, :, 0, :rem], tokens[:, :, full * ps:], to_pool)

    def _page_view(self, first: int, count: int) -> torch.Tensor:
        """Pages first .. first+count-1 as (2, layers, count, page_size, heads, dim): a view of the pool."""
        view = self.kv[:, :, first:first + count]
        return view if self.spec.layout is Layout.NHD else view.transpose(3, 4)

    def _move_indexed(self, pages: np.ndarray, whole: torch.Tensor, to_pool: bool) -> None:
        idx = self._index(pages)
        if self.spec.layout is Layout.HND:
            whole = whole.transpose(3, 4)  # now in the pool's page layout
        if to_pool:
            self.kv.index_copy_(2, idx, whole.to(self.device))
            return
        buffer = None
        for k in range(2):
            for layer in range(self.spec.num_layers):
                target = whole[k, layer]
                if target.is_contiguous() and target.device == self.device:
                    torch.index_select(self.kv[k, layer], 0, idx, out=target)
                    continue
                if buffer is None:
                    buffer = torch.empty(target.shape, dtype=self.kv.dtype, device=self.device)
                torch.index_select(self.kv[k, layer], 0, idx, out=buffer)
                target.copy_(buffer)

    # --- checks ------------------------------------------------------------------------------------
    def check_pages(self, pages: Any) -> np.ndarray:
        """`pages` as an int64 array, each allocated and appearing once (PageStateError otherwise):
        for callers that drive `ops` directly on slices of one checked batch."""
        return self._pages(pages)

    def _pages(self, pages: Any) -> np.ndarray:
        arr = as_page_array(pages, self.num_pages)
        if has_duplicates(arr):
            raise PageStateError("the same page appears twice; gather/scatter need distinct pages")
        self.allocator.require_allocated(arr)
        return arr

    def _index(self, arr: np.ndarray) -> torch.Tensor:
        return device_index(arr, self.device)

    def _check_tensor(self, what: str, tensor: Any, shape: tuple[int, ...]) -> None:
        check_tensor(what, tensor, shape, self.kv.dtype, self.spec.model_id)


def device_index(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """Integer `arr` as a tensor on `device`. On CUDA it goes up from pinned memory without the
    host waiting for the current stream (a plain upload would wait for all work queued there, such
    as a load still in flight); the copy is queued on the current stream, so work queued after it
    there, or on a stream that waits for it, reads it."""
    index = torch.from_numpy(np.ascontiguousarray(arr))
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def usable_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, or a ValueError naming why the pool cannot live there (torch's
    own answer for a missing GPU is an AssertionError deep inside the allocation)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device (cpu, cuda, cuda:1, ...): {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: torch {torch.__version__} sees no CUDA device "
                             "(a CPU build, or no GPU here); use device 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type != "cpu":
        raise ValueError(f"device {str(device)!r}: the page pool lives on 'cpu' or 'cuda[:N]'")
    return dev


def check_tensor(what: str, tensor: Any, shape: tuple[int, ...], dtype: torch.dtype, model: str) -> None:
    """Raise KVShapeError unless `tensor` is a dense torch.Tensor holding data (any real device) of
    exactly `shape` and `dtype`. Cheap: call it before allocating anything."""
    if not isinstance(tensor, torch.Tensor):
        raise KVShapeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise KVShapeError(f"{what} has layout {tensor.layout}, expected a dense torch.strided tensor "
                           "(call .to_dense() first)")
    if tensor.device.type == "meta":
        raise KVShapeError(f"{what} is on the meta device and holds no data; expected a tensor on a real device")
    if tuple(tensor.shape) != shape:
        raise KVShapeError(f"{what} has shape {tuple(tensor.shape)}, expected {shape} for {model}")
    if tensor.dtype != dtype:
        raise KVShapeError(f"{what} has dtype {tensor.dtype}, expected {dtype} (no silent casts)")


_MAX_RUN_COPIES = 16


def _page_heads(slots: np.ndarray, page_size: int) -> np.ndarray | None:
    """The pages `slots` fill, in order, when slot i = heads[i // page_size] * page_size +
    i % page_size (whole pages from offset 0; the last may stop early). None for any other order."""
    heads = slots[::page_size] // page_size
    n = slots.size
    expected = np.repeat(heads * page_size, page_size)[:n] + np.arange(n) % page_size
    return heads if np.array_equal(slots, expected) else None


def _count_runs(pages: np.ndarray) -> int:
    return int(pages.size > 0) + int(np.count_nonzero(np.diff(pages) != 1))


def consecutive_runs(pages: np.ndarray) -> list[tuple[int, int, int]]:
    """(index into `pages`, first number, length) of each run of consecutive numbers (pages, or
    host RAM rows): each run moves as one copy."""
    if not pages.size:
        return []
    starts = np.r_[0, np.flatnonzero(np.diff(pages) != 1) + 1]
    ends = np.r_[starts[1:], pages.size]
    return [(int(s), int(pages[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def _copy(pool_view: torch.Tensor, tokens: torch.Tensor, to_pool: bool) -> None:
    if to_pool:
        pool_view.copy_(tokens)
    else:
        tokens.copy_(pool_view)
