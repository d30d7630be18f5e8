"""What one SGLang HiCache page is to our store: its key, its spec, and where it lies in the host pool.

A page's bytes are SGLang's own flat data page (`get_data_page(index, flat=True)`: what its `file`
backend stores and its generic get/set hand over), so pages written through the zero-copy v1
calls and through the generic ones are the same blobs. The v1 calls reach those bytes where they
lie in the host pool: the non-flat `get_data_page` is a strided view, and its C order is the flat
page's order, whatever the layout. Everything that changes a page's bytes (model identity,
layout, dtype, geometry, the rank's share of the heads) goes into the spec's fingerprint, so a
page of another model, layout or TP split is a miss, never a wrong page. SGLang-free: the pool is
duck-typed (`page_size`, `layout`, `dtype`, `get_data_page`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiered_cache.model.spec import DType, KVSpec

_KEY_DOMAIN = b"tiered-cache sglang page v1\0"


def rank_tag(tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1, cp_rank: int = 0, cp_size: int = 1,
             replicated: bool = False) -> str:
    """Which share of a model's KV a rank holds: its TP rank (unless every rank holds the same KV,
    as MLA's do), its pipeline stage and its context-parallel slice."""
    tag = "all-heads" if replicated else f"tp{tp_rank}of{tp_size}"
    if pp_size > 1:
        tag += f"-pp{pp_rank}of{pp_size}"
    if cp_size > 1:
        tag += f"-cp{cp_rank}of{cp_size}"
    return tag


@dataclass(frozen=True)
class PageFormat:
    """The pages of one host pool, for one model and rank."""

    spec: KVSpec
    page_size: int  # tokens per page

    @classmethod
    def of_pool(cls, pool: Any, model_id: str, rank: str) -> PageFormat:
        """The format of `pool`'s pages. The spec's geometry is the page's bytes (layers, then a
        head dimension that makes up the rest), its model id the real identity and layout."""
        try:
            page = pool.get_data_page(0, flat=False)
        except Exception as exc:  # a pool whose pages are no flat data page (an asymmetric K/V width, ...)
            raise ValueError(f"tiered-cache cannot store the pages of SGLang's {type(pool).__name__} (layout "
                             f"{getattr(pool, 'layout', '?')}): {type(exc).__name__}: {exc}") from None
        nbytes = page.numel() * page.element_size()
        dtype = _page_dtype(page.dtype)
        layers = int(getattr(pool, "layer_num", 1) or 1)
        per_layer = 2 * pool.page_size * dtype.itemsize * layers
        if nbytes % per_layer:
            layers, per_layer = 1, 2 * pool.page_size * dtype.itemsize
        span = f"layers{getattr(pool, 'start_layer', 0)}-{getattr(pool, 'end_layer', '')}"  # a pipeline stage's
        model = f"{model_id}|sglang:{pool.layout}:{type(pool).__name__}:{page.dtype}:{tuple(page.shape)}|{rank}|{span}"
        spec = KVSpec(model_id=model, num_layers=layers, num_kv_heads=1, head_dim=nbytes // per_layer,
                      dtype=dtype, page_size=pool.page_size)
        if spec.bytes_per_page != nbytes:
            raise ValueError(f"an SGLang page of {nbytes} bytes has no page geometry here")
        return cls(spec, pool.page_size)

    def key(self, sglang_key: str) -> bytes:
        """Our 32-byte page key for SGLang's key of a page (a hash of its tokens' chain)."""
        return hashlib.sha256(_KEY_DOMAIN + self.spec.fingerprint.encode() + b"\0" + sglang_key.encode()).digest()

    def pool_pages(self, pool: Any, host_indices: torch.Tensor, count: int) -> list[np.ndarray]:
        """The first `count` pages of `host_indices` (token slots, a page's worth each) as uint8
        views into the pool, in flat-page order: where v1 reads land and writes come from."""
        starts = host_indices[: count * self.page_size : self.page_size].tolist()
        return [byte_view(pool.get_data_page(int(start), flat=False)) for start in starts]


def _page_dtype(dtype: torch.dtype) -> DType:
    """The page's element type for its spec; a type we do not store by name (int8, fp8 e5m2, ...)
    as 1-byte elements: the geometry then counts bytes, and the model id carries the real type."""
    try:
        return DType.parse(dtype)
    except ValueError:
        return DType.FP8_E4M3


def byte_view(page: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a uint8 numpy view of the same memory, no copy, strides kept (its last axis,
    contiguous, becomes bytes)."""
    if page.device.type != "cpu":
        raise ValueError(f"SGLang's host pool must be in CPU memory, got {page.device}")
    if page.dtype != torch.uint8:
        page = page.view(torch.uint8)
    return page.numpy()
