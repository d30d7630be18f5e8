"""What the radix tree's calls return: `SizeInfo`, `MatchResult`, `InsertResult`, `EvictedNode`."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tiered_cache.index.radix_node import RadixNode


class SizeInfo(NamedTuple):
    """Cached pages by lock state; `evictable + protected` is everything the tree holds."""

    evictable: int
    protected: int

    @property
    def total(self) -> int:
        return self.evictable + self.protected


class MatchResult(NamedTuple):
    """Longest cached prefix: `node` is the handle to lock, `values` the page indices in order."""

    node: RadixNode
    num_pages: int
    values: np.ndarray


class InsertResult(NamedTuple):
    """`num_existing` leading pages were already cached (the caller may free its copies of them);
    `node` is the handle of the node ending at the last inserted page."""

    num_existing: int
    node: RadixNode


class EvictedNode(NamedTuple):
    """A removed leaf: pages `start .. start+len(keys)` of some sequence in `namespace`."""

    namespace: str
    start: int
    keys: list[bytes]
    values: np.ndarray
