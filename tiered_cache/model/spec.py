"""KV geometry of one model: how many bytes a token and a page take, and a stable fingerprint.

Pure and import-light (no torch at import time): every size in the project derives from here.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any

from tiered_cache.model.dtype import DType

__all__ = ["PAGE_FORMAT_VERSION", "DType", "KVSpec", "Layout"]

# Bump when the meaning of a page's bytes changes for the same geometry (e.g. a new page layout).
PAGE_FORMAT_VERSION = 1


class Layout(enum.Enum):
    """Order of the token and head axes inside one page (DESIGN.md §6).

    NHD: (page_size, kv_heads, head_dim), the contract default, as in the tensor API.
    HND: (kv_heads, page_size, head_dim), what some attention kernels prefer.
    """

    NHD = "nhd"
    HND = "hnd"


@dataclass(frozen=True)
class KVSpec:
    """KV cache geometry of one model, plus the page size it is cached with.

    Everything that changes the bytes of a page is a field here, and all of it goes into
    `fingerprint`: two specs with equal fingerprints produce interchangeable pages.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = DType.FP16
    page_size: int = 16
    layout: Layout = Layout.NHD

    def __post_init__(self) -> None:
        if not self.model_id or not isinstance(self.model_id, str):
            raise ValueError(f"model_id must be a non-empty string, got {self.model_id!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if not isinstance(self.layout, Layout):
            try:
                object.__setattr__(self, "layout", Layout(str(self.layout).lower()))
            except ValueError:
                raise ValueError(f"layout must be 'nhd' or 'hnd', got {self.layout!r}") from None

    # --- sizes -------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers: 2 × layers × kv_heads × head_dim × itemsize."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Exact KV bytes of `num_tokens` tokens, not rounded to pages."""
        return self.bytes_per_token * num_tokens

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens (the last one may be partial)."""
        return math.ceil(num_tokens / self.page_size)

    def full_pages(self, num_tokens: int) -> int:
        """Pages completely filled by `num_tokens` tokens: only these are cached (DESIGN.md §4)."""
        return num_tokens // self.page_size

    # --- shapes (DESIGN.md §6) -------------------------------------------------------------------
    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Tensor-API shape of the KV of `num_tokens` tokens: (layers, 2, n, kv_heads, head_dim)."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def page_inner_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K (or V) inside a page, in this spec's layout."""
        if self.layout is Layout.NHD:
            return (self.page_size, self.num_kv_heads, self.head_dim)
        return (self.num_kv_heads, self.page_size, self.head_dim)

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        """Device pool, layer-first: (2, layers, pages, *page_inner_shape)."""
        return (2, self.num_layers, num_pages, *self.page_inner_shape)

    def staging_shape(self, num_pages: int) -> tuple[int, ...]:
        """Staging buffer, page-first: (pages, layers, 2, *page_inner_shape); one page is contiguous."""
        return (num_pages, self.num_layers, 2, *self.page_inner_shape)

    # --- identity ------------------------------------------------------------------------------
    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 (hex) over everything that changes a page's bytes, plus the model id."""
        fields = {
            "format": PAGE_FORMAT_VERSION,
            "model_id": self.model_id,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype.value,
            "page_size": self.page_size,
            "layout": self.layout.value,
        }
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest()

    def with_options(self, **changes: Any) -> KVSpec:
        """A copy with some fields changed (e.g. `dtype="bf16"`, `page_size=64`)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["dtype"] = self.dtype.value
        out["layout"] = self.layout.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVSpec:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown KVSpec field(s): {', '.join(sorted(unknown))}")
        return cls(**data)
