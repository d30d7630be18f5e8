"""`ApproxPrefixTree`: which worker was sent (and so probably holds) which prompt prefix.

A radix tree over characters of prompt text (the router sees text, not tokens; a prefix of the
text is a prefix of the tokens, give or take the last one). Each node records, per worker, when
it last sent that worker a prompt through the node. It is approximate on purpose: a worker may
have evicted what it was sent, and the tree is pruned to a budget per worker, least recently
used leaves first. Matching a text that leaves an edge midway counts the common characters.
Thread-safe (one lock). Ray-free.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    edge: str = ""  # characters from the parent to this node
    parent: _Node | None = None
    children: dict[str, _Node] = field(default_factory=dict)  # first character -> child
    last_used: dict[str, int] = field(default_factory=dict)  # worker -> tick of its latest visit


class ApproxPrefixTree:
    def __init__(self) -> None:
        self._root = _Node()
        self._chars: dict[str, int] = {}  # worker -> characters of edges it is recorded on
        self._lock = threading.Lock()
        self._tick = itertools.count(1)

    # --- reading ----------------------------------------------------------------------------------
    def longest_match(self, text: str) -> tuple[str | None, int]:
        """(worker, characters) of the longest prefix of `text` recorded for any worker; ties go to
        the worker that used the deepest node last. (None, 0) when nothing matches."""
        with self._lock:
            best: tuple[str | None, int] = (None, 0)
            for node, depth in self._path(text):
                if node.last_used:
                    best = (max(node.last_used, key=lambda w: (node.last_used[w], w)), depth)
            return best

    def matched_chars(self, text: str, worker: str) -> int:
        """Characters of the longest prefix of `text` recorded for `worker`."""
        with self._lock:
            found = 0
            for node, depth in self._path(text):
                if worker in node.last_used:
                    found = depth
            return found

    def chars(self, worker: str) -> int:
        """Characters recorded for `worker` (its share of the tree: how much it probably caches)."""
        with self._lock:
            return self._chars.get(worker, 0)

    def workers(self) -> list[str]:
        with self._lock:
            return sorted(self._chars)

    # --- changing ---------------------------------------------------------------------------------
    def insert(self, text: str, worker: str) -> None:
        """Record that `worker` was sent `text` (every prefix of it), now."""
        with self._lock:
            tick = next(self._tick)
            node, rest = self._root, text
            self._chars.setdefault(worker, 0)
            while rest:
                child = node.children.get(rest[0])
                if child is None:
                    child = _Node(rest, node)
                    node.children[rest[0]] = child
                    self._visit(child, worker, tick)
                    return
                common = _common(child.edge, rest)
                if common < len(child.edge):
                    child = self._split(child, common)
                self._visit(child, worker, tick)
                node, rest = child, rest[common:]

    def remove_worker(self, worker: str) -> None:
        """Forget everything recorded for `worker` (it left the cluster)."""
        with self._lock:
            for node in list(self._nodes()):
                if node.last_used.pop(worker, None) is not None:
                    self._drop_if_unused(node)
            self._chars.pop(worker, None)

    def evict(self, max_chars_per_worker: int) -> int:
        """Forget the least recently used leaves of each worker over `max_chars_per_worker`, until
        it is within budget. Returns characters forgotten."""
        with self._lock:
            forgotten = 0
            for worker, total in list(self._chars.items()):
                if total <= max_chars_per_worker:
                    continue
                # A worker's leaves: its nodes none of whose children it is recorded on.
                leaves = [n for n in self._nodes() if worker in n.last_used
                          and not any(worker in c.last_used for c in n.children.values())]
                leaves.sort(key=lambda n: n.last_used[worker])
                while leaves and self._chars[worker] > max_chars_per_worker:
                    leaf = leaves.pop(0)
                    forgotten += len(leaf.edge)
                    self._chars[worker] -= len(leaf.edge)
                    del leaf.last_used[worker]
                    parent = leaf.parent
                    self._drop_if_unused(leaf)
                    if parent is not None and parent is not self._root and worker in parent.last_used \
                            and not any(worker in c.last_used for c in parent.children.values()):
                        # The parent became one of the worker's leaves: keep recency order.
                        position = next((i for i, n in enumerate(leaves)
                                         if n.last_used[worker] > parent.last_used[worker]), len(leaves))
                        leaves.insert(position, parent)
            return forgotten

    # --- internals (lock held) -------------------------------------------------------------------
    def _path(self, text: str) -> list[tuple[_Node, int]]:
        """Nodes along `text` with the characters matched at each (partial on the last edge)."""
        out, node, depth, rest = [], self._root, 0, text
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                break
            common = _common(child.edge, rest)
            depth += common
            out.append((child, depth))
            if common < len(child.edge):
                break
            node, rest = child, rest[common:]
        return out

    def _visit(self, node: _Node, worker: str, tick: int) -> None:
        if worker not in node.last_used:
            self._chars[worker] += len(node.edge)
        node.last_used[worker] = tick

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` characters; the new middle node inherits its workers."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.edge)
        middle = _Node(child.edge[:at], parent, {child.edge[at]: child}, dict(child.last_used))
        parent.children[child.edge[0]] = middle
        child.edge, child.parent = child.edge[at:], middle
        return middle

    def _drop_if_unused(self, node: _Node) -> None:
        while node is not self._root and not node.last_used and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.edge[0]]
            node = parent

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
