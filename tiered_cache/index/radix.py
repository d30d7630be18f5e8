"""`RadixTree`: the page-aligned prefix index of one instance.

Edges are labelled with page keys (`tiered_cache.index.keys`), one key per page. Keys chain over the
whole prefix and are rooted in a namespace, so a match is always page-aligned and two namespaces
never share a node; each namespace also gets its own root so that even equal keys could not meet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tiered_cache.errors import IntegrityError, StaleHandleError
from tiered_cache.index.eviction_queue import EvictionPolicy, EvictionQueue
from tiered_cache.index.radix_node import RadixNode
from tiered_cache.index.radix_results import EvictedNode, InsertResult, MatchResult, SizeInfo

_NO_VALUES = np.empty(0, dtype=np.int64)


def _common_length(node_keys: list[bytes], keys: Sequence[bytes], start: int) -> int:
    limit = min(len(node_keys), len(keys) - start)
    i = 0
    while i < limit and node_keys[i] == keys[start + i]:
        i += 1
    return i


def _require_live(node: RadixNode, call: str) -> None:
    if node.removed:
        raise StaleHandleError(f"{call}() on {node!r}: the node was evicted and its values may now hold "
                               "other tokens; match the prefix again for a live handle")


class RadixTree:
    """Prefix index over page keys, with lock reference counts and leaf eviction.

    Sizes are counted in pages. Every public call keeps these invariants, which
    `check_integrity()` verifies: evictable + protected == pages held; a node with
    `lock_ref > 0` is never evicted; exactly the unlocked leaves are in the eviction queue.
    """

    def __init__(self, policy: EvictionPolicy | str = EvictionPolicy.LRU) -> None:
        self.policy = EvictionPolicy(policy)
        self._roots: dict[str, RadixNode] = {}
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._queue = EvictionQueue.of_policy(self.policy)
        # Told of every page the tree gains (namespace, keys, the key before them or None) and
        # loses (keys): KV events. Called with the owner's lock held; they must be quick.
        self.on_insert: Callable[[str, list[bytes], bytes | None], None] | None = None
        self.on_remove: Callable[[list[bytes]], None] | None = None

    # --- queries ---------------------------------------------------------------------------------
    def size_info(self) -> SizeInfo:
        return SizeInfo(self._evictable, self._protected)

    @property
    def num_nodes(self) -> int:
        """Nodes holding pages (namespace roots not counted)."""
        return self._num_nodes

    def namespaces(self) -> list[str]:
        return sorted(self._roots)

    def branches(self, namespace: str) -> list[RadixNode]:
        """The nodes right under `namespace`'s root (read them under the owner's lock)."""
        root = self._roots.get(namespace)
        return list(root.children.values()) if root is not None else []

    def match_prefix(self, keys: Sequence[bytes], namespace: str = "") -> MatchResult:
        """Longest cached prefix of `keys` in `namespace`, in whole pages.

        Marks the matched nodes as used (LRU time, LFU hits). A match that ends inside a node
        splits it, so the returned handle covers exactly the matched pages. Returns the
        namespace root as the handle when nothing matches.
        """
        found: list[np.ndarray] = []
        node, i = self._walk(self._root(namespace), keys, found)
        if node.queued:
            self._refresh(node)
        values = np.concatenate(found) if found else _NO_VALUES
        return MatchResult(node, i, values)

    # --- changes ---------------------------------------------------------------------------------
    def insert(self, keys: Sequence[bytes], values: Any, namespace: str = "") -> InsertResult:
        """Cache `keys` (one per page) with `values` (one page index each) in `namespace`.

        Pages already cached keep their existing values: the result says how many leading pages
        that was, so the caller can free its duplicate pages. The new pages form one new leaf.
        The tree keeps its own copy of the values it stores, so
        the caller may reuse `values` afterwards.
        """
        vals = np.asarray(values, dtype=np.int64).reshape(-1)
        if vals.size != len(keys):
            raise ValueError(f"insert() needs one value per page key: {len(keys)} keys, {vals.size} values")
        node, i = self._walk(self._root(namespace), keys, None)
        existing = i
        if i < len(keys):
            # A copy, never a view: a view would pin the caller's whole array and follow its changes.
            leaf = RadixNode(namespace, node, list(keys[i:]), vals[i:].copy(), node.end)
            leaf.last_access = self._clock
            node.children[leaf.keys[0]] = leaf
            self._num_nodes += 1
            self._evictable += len(leaf)
            self._refresh(node)  # it may have been a leaf until now
            self._refresh(leaf)
            if self.on_insert is not None:
                self.on_insert(namespace, leaf.keys, node.keys[-1] if node.keys else None)
            node = leaf
        elif node.queued:
            self._refresh(node)
        return InsertResult(existing, node)

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction until a matching `unlock`.

        Raises StaleHandleError if `node` was evicted since it was returned (match again)."""
        _require_live(node, "lock")
        if node.is_root:
            return
        node.own_locks += 1
        current: RadixNode | None = node
        while current is not None and not current.is_root:
            if current.lock_ref == 0:
                self._evictable -= len(current)
                self._protected += len(current)
            current.lock_ref += 1
            if not current.children:
                self._refresh(current)
            current = current.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`. Raises ValueError for an unlock without a lock (StaleHandleError,
        a ValueError too, if `node` was evicted, which a locked node never is)."""
        _require_live(node, "unlock")
        if node.is_root:
            return
        if node.own_locks <= 0:
            raise ValueError(f"unlock() without a matching lock() on {node!r}")
        node.own_locks -= 1
        current: RadixNode | None = node
        while current is not None and not current.is_root:
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self._protected -= len(current)
                self._evictable += len(current)
                if not current.children:
                    self._refresh(current)
            current = current.parent

    def evict(self, num_pages: int) -> list[EvictedNode]:
        """Remove unlocked leaves, lowest priority first, until at least `num_pages` pages are gone
        or nothing evictable is left. Whole nodes are removed; the caller frees or demotes the
        returned values."""
        evicted: list[EvictedNode] = []
        freed = 0
        while freed < num_pages:
            node = self._queue.pop()
            if node is None:
                break
            self._remove_leaf(node)
            evicted.append(EvictedNode(node.namespace, node.start, node.keys, node.values))
            freed += len(node)
        return evicted

    # --- internals -------------------------------------------------------------------------------
    def _walk(self, node: RadixNode, keys: Sequence[bytes],
              found: list[np.ndarray] | None) -> tuple[RadixNode, int]:
        """Follow `keys` down from `node`, splitting a node the keys leave midway, and mark each
        node passed as used now. A match (`found` given) also counts a hit and collects values.
        Returns the deepest node reached and the number of pages matched."""
        clock, now = self._tick(), time.monotonic()
        node.last_access, node.touched = clock, now
        i = 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            # NOTE: the child is keyed by its first page, so at least one page matches here.
            matched = _common_length(child.keys, keys, i)
            if matched < len(child):
                child = self._split(child, matched)
            child.last_access, child.touched = clock, now
            if found is not None:
                child.hits += 1
                found.append(child.values)
            node, i = child, i + matched
        return node, i

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _root(self, namespace: str) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            if not isinstance(namespace, str):
                raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
            root = self._roots[namespace] = RadixNode(namespace, None, [], _NO_VALUES, 0)
        return root

    def _refresh(self, node: RadixNode) -> None:
        eligible = not node.is_root and not node.children and node.lock_ref == 0
        if eligible or node.queued:
            self._queue.refresh(node, eligible)

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut `child` after `at` pages; the new node takes the head and becomes child's parent.

        The new node sits on every path through `child`, so it inherits child's lock_ref, access
        history; sizes are unchanged. `child` keeps its identity (handles to it stay
        valid) and its place in the eviction queue.
        """
        parent = child.parent
        assert parent is not None and 0 < at < len(child)
        head = RadixNode(child.namespace, parent, child.keys[:at], child.values[:at].copy(), child.start)
        head.lock_ref = child.lock_ref
        head.last_access, head.touched = child.last_access, child.touched
        head.hits = child.hits
        parent.children[head.keys[0]] = head
        child.keys = child.keys[at:]
        child.values = child.values[at:].copy()  # each node owns exactly its slice
        child.start += at
        child.parent = head
        head.children[child.keys[0]] = child
        self._num_nodes += 1
        return head

    def _remove_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.keys[0]]
        node.parent = None
        node.removed = True  # handles to it are stale from now on
        self._num_nodes -= 1
        self._evictable -= len(node)
        if not parent.children:
            self._refresh(parent)
        if self.on_remove is not None:
            self.on_remove(node.keys)

    def all_values(self) -> np.ndarray:
        """The values (pool pages) of every node, in no particular order."""
        values = [_NO_VALUES]
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                values.append(node.values)
                stack.extend(node.children.values())
        return np.concatenate(values)

    # --- integrity -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Verify every structural and accounting invariant; raise IntegrityError on the first break."""
        evictable = protected = nodes = queued = 0
        live = self._queue.live_nodes()
        for namespace, root in self._roots.items():
            if root.parent is not None or root.keys or root.lock_ref:
                raise IntegrityError(f"root of namespace {namespace!r} is malformed: {root!r}")
            stack = list(root.children.items())
            while stack:
                first_key, node = stack.pop()
                nodes += 1
                parent = node.parent
                if parent is None or parent.children.get(first_key) is not node:
                    raise IntegrityError(f"{node!r} is not linked from its parent")
                if not node.keys or node.keys[0] != first_key or len(node.values) != len(node.keys):
                    raise IntegrityError(f"{node!r} has {len(node.keys)} keys and {len(node.values)} values")
                if node.removed or node.values.base is not None:
                    raise IntegrityError(f"{node!r} is marked evicted or holds a view instead of its own values")
                if node.namespace != namespace or node.start != parent.end:
                    raise IntegrityError(f"{node!r} has the wrong namespace or start")
                expected_lock = node.own_locks + sum(c.lock_ref for c in node.children.values())
                if node.lock_ref != expected_lock or node.own_locks < 0:
                    raise IntegrityError(f"{node!r}: lock_ref {node.lock_ref} != {expected_lock} expected")
                if node.lock_ref:
                    protected += len(node)
                else:
                    evictable += len(node)
                eligible = not node.children and node.lock_ref == 0
                if eligible != node.queued or eligible != (node.id in live):
                    raise IntegrityError(f"{node!r}: evictable leaf={eligible} but queued={node.queued}")
                queued += eligible
                stack.extend(node.children.items())
        if (evictable, protected) != (self._evictable, self._protected):
            raise IntegrityError(f"size accounting: counted evictable={evictable} protected={protected}, "
                                 f"recorded {self._evictable} and {self._protected}")
        if nodes != self._num_nodes or queued != self._queue.num_queued:
            raise IntegrityError(f"counted {nodes} nodes / {queued} queued, recorded "
                                 f"{self._num_nodes} / {self._queue.num_queued}")
