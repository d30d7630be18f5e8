"""The prefixes `bench pool-load` moves: each about `mib` MiB of KV, with tokens, page keys and
pages (page-first) of its own, so that a reader can be handed a prefix it has never read.

Prefix `index` has the tokens `[index * n, (index + 1) * n)` (so its keys share nothing with
another's) and the pages of one random block rolled by `index` pages (so page `j` of two
prefixes differs too, without drawing new random numbers for every prefix).
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tiered_cache.model.spec import KVSpec

NAMESPACE = "bench-pool-load"


class Prefix:
    """Prefix `index` of about `mib` MiB of KV (see the module doc); `base` is the random block
    every prefix of a run rolls (drawn when not given)."""

    def __init__(self, spec: KVSpec, mib: float, index: int = 0, base: torch.Tensor | None = None) -> None:
        self.spec = spec
        self.index = index
        self.num_pages = max(1, int(mib * 2**20) // spec.bytes_per_page)
        n = self.num_pages * spec.page_size
        self.tokens = list(range(index * n, (index + 1) * n))
        self.nbytes = self.num_pages * spec.bytes_per_page
        self._base = base

    @cached_property
    def keys(self) -> list[bytes]:
        from tiered_cache.index.keys import PageKeyer

        return PageKeyer(self.spec, NAMESPACE).keys(self.tokens)

    @cached_property
    def pages(self) -> torch.Tensor:
        import torch

        base = self._base if self._base is not None else random_pages(self.spec, self.num_pages)
        return torch.roll(base, self.index, dims=0) if self.index % self.num_pages else base

    def kv(self) -> torch.Tensor:
        """The prefix's KV in the tensor API's shape (layers, 2, tokens, heads, dim)."""
        order = (1, 2, 0, *range(3, self.pages.dim()))  # (pages, L, 2, *inner) -> (L, 2, pages, *inner)
        whole = self.pages.permute(order)
        if self.spec.page_inner_shape[0] != self.spec.page_size:  # HND pages: (heads, page, dim)
            whole = whole.transpose(3, 4)
        return whole.reshape(self.spec.kv_shape(len(self.tokens)))

    def blobs(self) -> list[tuple[bytes, bytes]]:
        from tiered_cache.wire.codec import encode_page

        return [(k, encode_page(p, self.spec, k)) for k, p in zip(self.keys, self.pages, strict=True)]

    def drop_pages(self) -> None:
        """Forget the pages (a run of many prefixes keeps only the ones it still needs)."""
        self.__dict__.pop("pages", None)


class Prefixes:
    """The prefixes of one run, made on demand from one random block (same seed in every process:
    a reader process started for the bench rebuilds the same prefixes)."""

    def __init__(self, spec: KVSpec, mib: float) -> None:
        self.spec = spec
        self.mib = mib
        self.num_pages = Prefix(spec, mib).num_pages
        self._base: torch.Tensor | None = None

    def __getitem__(self, index: int) -> Prefix:
        if self._base is None:
            self._base = random_pages(self.spec, self.num_pages)
        return Prefix(self.spec, self.mib, index, self._base)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.spec.bytes_per_page


def random_pages(spec: KVSpec, num_pages: int) -> torch.Tensor:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(spec.staging_shape(num_pages), generator=generator).to(spec.dtype.torch)
