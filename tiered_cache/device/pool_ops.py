"""The data movements of a page pool, behind one small interface.

`TorchPageOps` works on any torch device and is the reference: faster implementations (the CuPy
kernels under `kernels/`) register under another name and must produce identical bytes.

Shapes (DESIGN.md §6), with `inner` = the spec's `page_inner_shape`:
    pool     (2, layers, num_pages, *inner)      layer-first
    staging  (n_pages, layers, 2, *inner)        page-first, one page contiguous
    kv       (layers, 2, n_tokens, heads, dim)   tensor API
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tiered_cache.model.spec import Layout


class PageOps(Protocol):
    name: str

    def write(self, pool: Any, layout: Layout, page_size: int, slots: Any, kv: Any) -> None:
        """Write token i of `kv` into flat slot `slots[i]` (= page * page_size + offset)."""

    def gather(self, pool: Any, pages: Any, out: Any) -> None:
        """Copy `pages` of the pool, in order, into the page-first `out`."""

    def scatter(self, pool: Any, pages: Any, staging: Any) -> None:
        """Copy page-first `staging` into `pages` of the pool (the reverse of gather)."""

    def copy(self, pool: Any, src: Any, dst: Any) -> None:
        """Copy pool page `src[i]` into pool page `dst[i]` (all distinct), every layer and K/V."""


class TorchPageOps:
    """Plain torch indexing: correct on every device, the reference for other implementations."""

    name = "torch"

    def write(self, pool: Any, layout: Layout, page_size: int, slots: Any, kv: Any) -> None:
        pages, offsets = slots // page_size, slots % page_size
        if layout is Layout.NHD:
            pool[:, :, pages, offsets] = kv.transpose(0, 1)  # (2, L, n, H, D)
        else:
            # Advanced indices split by a slice move to the front: the target is (n, 2, L, H, D).
            pool[:, :, pages, :, offsets] = kv.permute(2, 1, 0, 3, 4)

    def gather(self, pool: Any, pages: Any, out: Any) -> None:
        out.copy_(pool.index_select(2, pages).permute(2, 1, 0, *range(3, pool.dim())))

    def scatter(self, pool: Any, pages: Any, staging: Any) -> None:
        pool.index_copy_(2, pages, staging.permute(2, 1, 0, *range(3, pool.dim())))

    def copy(self, pool: Any, src: Any, dst: Any) -> None:
        raw = pool.view(torch.uint8)  # bytes: torch has no float8 indexing on the CPU
        raw.index_copy_(2, dst, raw.index_select(2, src))


_REGISTRY: dict[str, PageOps] = {"torch": TorchPageOps()}


def register_ops(ops: PageOps) -> None:
    _REGISTRY[ops.name] = ops


def _register_cupy() -> bool:
    """Register the CUDA kernels when CuPy and a device are there (imported only on first need)."""
    if "cupy" in _REGISTRY:
        return True
    from tiered_cache.device import cupy_ops

    if not cupy_ops.available():
        return False
    register_ops(cupy_ops.CupyPageOps())
    return True


def select_ops(device: Any, name: str | None = None) -> PageOps:
    """The implementation named `name`, or the best one for `device`: the CuPy kernels for a CUDA
    device when CuPy is installed, torch otherwise (both write identical bytes)."""
    if name is not None:
        if name == "cupy" and not _register_cupy():
            raise ValueError("page ops 'cupy' need CuPy and a CUDA device "
                             "(pip install cupy-cuda12x, or cupy-cuda13x for CUDA 13)")
        try:
            return _REGISTRY[name]
        except KeyError:
            raise ValueError(f"unknown page ops {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None
    if getattr(device, "type", str(device).split(":")[0]) == "cuda" and _register_cupy():
        return _REGISTRY["cupy"]
    return _REGISTRY["torch"]
