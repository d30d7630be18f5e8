"""Pages and blobs with known content for tier tests."""

from __future__ import annotations

import threading

import torch

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.wire.codec import encode_page

SPEC = KVSpec("tier-test", 2, 2, 16, page_size=4)  # 1 KiB pages


def keys_for(n: int, spec: KVSpec = SPEC, start: int = 0) -> list[bytes]:
    return PageKeyer(spec).keys(list(range(start, start + n * spec.page_size)))


def pages_for(n: int, spec: KVSpec = SPEC, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.staging_shape(n), generator=gen).to(spec.dtype.torch)


def blobs_for(n: int, spec: KVSpec = SPEC, seed: int = 0, start: int = 0) -> list[tuple[bytes, bytes]]:
    keys, pages = keys_for(n, spec, start), pages_for(n, spec, seed)
    return [(k, encode_page(p, spec, k)) for k, p in zip(keys, pages, strict=True)]


class HeldDisk(DiskTier):
    """A disk tier whose `get` waits until the test releases it: a slow tier, deterministically."""

    def __init__(self, path, capacity) -> None:
        super().__init__(path, capacity, fsync=False)
        self.entered = threading.Event()
        self.release = threading.Event()

    def get(self, keys):
        self.entered.set()
        assert self.release.wait(60), "the test never released the held disk get"
        return super().get(keys)
