"""`tiered-cache bench radix`: match, insert and evict cost per operation at a given tree size.

Baselines, measured in the same run: a flat dict lookup/insert per page (what a hash-map prefix
cache such as vLLM's does) and, for eviction, rebuilding a heap over all leaves on each call
(what made SGLang's evict take 70 ms at 41k leaves).
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable

from tiered_cache.bench.timing import Comparison
from tiered_cache.index.radix import RadixTree
from tiered_cache.index.radix_node import RadixNode

_PAGES_PER_BRANCH = 4  # new pages a branch adds below its fork point


def _fresh(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(32) for _ in range(n)]


def build_tree(num_nodes: int, rng: random.Random) -> tuple[RadixTree, list[list[bytes]]]:
    """A tree of about `num_nodes` nodes grown by forking random stored sequences at random pages."""
    tree = RadixTree()
    sequences: list[list[bytes]] = []
    while tree.num_nodes < num_nodes:
        seq = _branch(rng, sequences)
        tree.insert(seq, range(len(seq)))
        sequences.append(seq)
    return tree, sequences


def _branch(rng: random.Random, sequences: list[list[bytes]]) -> list[bytes]:
    if not sequences:
        return _fresh(rng, _PAGES_PER_BRANCH)
    base = rng.choice(sequences)
    return base[:rng.randrange(len(base) + 1)] + _fresh(rng, _PAGES_PER_BRANCH)


def _per_op(fn: Callable[[], int]) -> float:
    """Run `fn` (which returns how many operations it did) and return microseconds per operation."""
    start = time.perf_counter()
    ops = fn()
    return (time.perf_counter() - start) / max(ops, 1) * 1e6


def bench_radix(num_nodes: int, ops: int = 2000, seed: int = 0) -> list[Comparison]:
    rng = random.Random(seed)
    tree, sequences = build_tree(num_nodes, rng)
    flat = {key: i for seq in sequences for i, key in enumerate(seq)}
    probes = [rng.choice(sequences) for _ in range(ops)]
    scale = f"{tree.num_nodes:,}"

    matched = {"tree": 0, "dict": 0}  # pages each side found: the same, or one of them is wrong

    def match_tree() -> int:
        matched["tree"] = sum(tree.match_prefix(seq).num_pages for seq in probes)
        return len(probes)

    def match_dict() -> int:
        found = 0
        for seq in probes:
            for key in seq:
                if key not in flat:
                    break
                found += 1
        matched["dict"] = found
        return len(probes)

    new_seqs = [_branch(rng, sequences) for _ in range(ops)]

    def insert_tree() -> int:
        for seq in new_seqs:
            tree.insert(seq, range(len(seq)))
        return len(new_seqs)

    def insert_dict() -> int:
        for seq in new_seqs:
            for i, key in enumerate(seq):
                flat.setdefault(key, i)
        return len(new_seqs)

    evictions = min(ops, max(1, tree.num_nodes // 10))

    def evict_tree() -> int:
        for _ in range(evictions):
            tree.evict(1)
        return evictions

    def evict_rebuild_heap() -> int:
        # The naive way, on a snapshot of the same leaves: collect, heapify, pop one, every call.
        leaves = _leaves(tree)
        calls = min(evictions, 50)
        for _ in range(calls):
            heap = [(n.last_access, n.id, n) for n in leaves]
            heapq.heapify(heap)
            heapq.heappop(heap)
        return calls

    rows = [
        Comparison(scale, "match", _per_op(match_tree), "dict lookup per page", _per_op(match_dict), "µs/op", False,
                   matched["tree"], matched["dict"]),
        Comparison(scale, "insert", _per_op(insert_tree), "dict insert per page", _per_op(insert_dict),
                   "µs/op", False),
    ]
    naive = _per_op(evict_rebuild_heap)
    rows.append(Comparison(f"{tree.num_nodes:,}", "evict 1 leaf", _per_op(evict_tree), "heap rebuilt per call",
                           naive, "µs/op", False))
    tree.check_integrity()
    return rows


def _leaves(tree: RadixTree) -> list[RadixNode]:
    out: list[RadixNode] = []
    stack = [tree.match_prefix([]).node]
    while stack:
        node = stack.pop()
        if node.children:
            stack.extend(node.children.values())
        elif not node.is_root:
            out.append(node)
    return out
