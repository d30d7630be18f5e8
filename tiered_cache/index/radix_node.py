"""`RadixNode`: one edge of the radix tree (radix.py), the handle its calls give out."""

from __future__ import annotations

import itertools
import time

import numpy as np

_ids = itertools.count()


class RadixNode:
    """One edge of the tree: a run of consecutive pages and the values (page indices) that hold them.

    `lock_ref` counts the locks held on this node or any node below it, so a node with
    `lock_ref > 0` lies on the path of some live request and must not be evicted.
    """

    __slots__ = (
        "children",
        "hits",
        "id",
        "keys",
        "last_access",
        "lock_ref",
        "namespace",
        "own_locks",
        "parent",
        "queued",
        "qver",
        "removed",
        "start",
        "touched",
        "values",
    )

    def __init__(self, namespace: str, parent: RadixNode | None, keys: list[bytes], values: np.ndarray,
                 start: int) -> None:
        self.namespace = namespace
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.keys = keys
        self.values = values
        self.start = start  # index of this node's first page in the sequence
        self.lock_ref = 0
        self.own_locks = 0  # locks taken on this node as a handle
        self.last_access = 0
        self.touched = time.monotonic()  # when last matched or inserted (for `tiered-cache tree`)
        self.hits = 0
        self.id = next(_ids)
        self.qver = 0  # bumped whenever its entry in the eviction queue goes stale
        self.queued = False  # an unlocked leaf with a live entry in the eviction queue
        self.removed = False  # evicted: a handle to it is stale and must not be locked

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def is_root(self) -> bool:
        """A namespace root (an evicted node also has no parent, but is no root)."""
        return self.parent is None and not self.removed

    @property
    def end(self) -> int:
        """Pages matched from the root through the end of this node."""
        return self.start + len(self.keys)

    def __repr__(self) -> str:
        state = ", evicted" if self.removed else ""
        return (f"RadixNode(ns={self.namespace!r}, pages={self.start}..{self.end}, "
                f"lock_ref={self.lock_ref}, children={len(self.children)}{state})")
