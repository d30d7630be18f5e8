"""What `tiered-cache tree` draws: a snapshot of a cache's radix tree as plain data (JSON-ready).

Per namespace, the nodes of the device-side prefix tree: pages and tokens, where the pages are
(device, plus host RAM and the tiers below where copies are known), hits, seconds since last use,
whether a request holds it, and the first and last tokens of the node when the cache remembers
them (`PageTokens`: the tokens of pages it inserted, bounded). Pages that left the device live in
host RAM and below as flat keys, not in the tree: the snapshot counts them per tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tiered_cache.cache.page_tokens import PageTokens
from tiered_cache.index.radix import RadixTree
from tiered_cache.index.radix_node import RadixNode
from tiered_cache.tiers.base import Tier

if TYPE_CHECKING:
    from tiered_cache.tiers.chain import TierChain
    from tiered_cache.tiers.host import HostTier


def held_below(host: HostTier, chain: TierChain) -> Callable[[list[bytes]], list[str]]:
    """For `snapshot`: the tiers below the device known to hold all of a node's pages."""
    def where(keys: list[bytes]) -> list[str]:
        tiers = [Tier.HOST.value] if host.contains_prefix(keys) == len(keys) else []
        return tiers + [t.name for i, t in enumerate(chain.tiers) if all(chain.known_in(k, i) for k in keys)]
    return where


def _node_tokens(node: RadixNode, memo: PageTokens) -> tuple[list[int] | None, list[int] | None]:
    """The token ids of the node's first and last page, where remembered."""
    first, last = memo.get(node.keys[0]), memo.get(node.keys[-1])
    return (first.tolist() if first is not None else None), (last.tolist() if last is not None else None)


def snapshot(tree: RadixTree, page_size: int, memo: PageTokens, where: Callable[[list[bytes]], list[str]],
             max_nodes: int = 500) -> dict[str, Any]:
    """The tree as nested dicts (call under the cache's lock). `where(keys)` names the tiers that
    also hold all of a node's pages (beyond the device). At most `max_nodes` nodes, the largest
    branches first; `truncated` says whether some were left out."""
    now, budget = time.monotonic(), [max_nodes]
    namespaces = []
    for ns in tree.namespaces():
        roots = tree.branches(ns)
        sizes = _subtree_pages(roots)
        namespaces.append({"namespace": ns,
                           "children": _children(roots, sizes, page_size, memo, where, now, budget)})
    return {"page_size": page_size, "namespaces": namespaces, "nodes": tree.num_nodes,
            "truncated": budget[0] < 0}


def _subtree_pages(roots: list[RadixNode]) -> dict[int, int]:
    """Pages under each node (itself included), by node id: one pass, children before parents."""
    order, stack = [], list(roots)
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    sizes: dict[int, int] = {}
    for node in reversed(order):
        sizes[node.id] = len(node.keys) + sum(sizes[c.id] for c in node.children.values())
    return sizes


def _children(nodes: list[RadixNode], sizes: dict[int, int], page_size: int, memo: PageTokens,
              where: Callable[[list[bytes]], list[str]], now: float, budget: list[int]) -> list[dict[str, Any]]:
    out = []
    for node in sorted(nodes, key=lambda n: sizes[n.id], reverse=True):
        budget[0] -= 1
        if budget[0] < 0:
            break
        head, tail = _node_tokens(node, memo)
        out.append({
            "pages": len(node.keys), "tokens": len(node.keys) * page_size, "first_page": node.start,
            "where": [Tier.DEVICE.value, *where(node.keys)], "hits": node.hits,
            "idle_s": round(now - node.touched, 3), "in_use": node.lock_ref > 0,
            "head_tokens": head, "tail_tokens": tail,
            "children": _children(list(node.children.values()), sizes, page_size, memo, where, now, budget),
            "subtree_pages": sizes[node.id],
        })
    return out


def decode_previews(tree: dict[str, Any], decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """Add `head_text` / `tail_text` to every node whose tokens are known (in place; returns it).
    Siblings split inside a page (their first pages differ after some tokens they share): each
    one's head text starts where they part (`head_skipped_tokens` says how many were left out),
    so two leaves never show the same text."""
    groups = [ns["children"] for ns in tree["namespaces"]]
    while groups:
        siblings = groups.pop()
        skip = _shared_head(siblings)
        for node in siblings:
            head, tail = node.get("head_tokens"), node.get("tail_tokens")
            if head:
                node["head_text"] = decode(head[skip:])
                node["head_skipped_tokens"] = skip
            if tail:
                node["tail_text"] = decode(tail)
            groups.append(node["children"])
    return tree


def _shared_head(siblings: list[dict[str, Any]]) -> int:
    """How many leading tokens every sibling's first page shares with the others (0 for one)."""
    heads = [node.get("head_tokens") or [] for node in siblings]
    if len(heads) < 2 or not all(heads):
        return 0
    n = 0
    while all(n < len(h) - 1 for h in heads) and len({h[n] for h in heads}) == 1:
        n += 1  # at least the last token of each head stays, so a head is never empty
    return n


def tree_of(cache: Any, max_nodes: int, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    """What `TieredCache.prefix_tree()` returns (`cache`: the `TieredCache`; typed loosely, as the
    cache imports this module): the tree's snapshot (taken under the cache's lock), each tier's
    page count and the reuse policy's figures; with `decode`, page previews."""
    core = cache.core
    with core.lock:
        view = snapshot(core.tree, core.spec.page_size, core.ledger.page_tokens,
                        held_below(core.host, core.chain), max_nodes)
    stats = cache.stats()
    view["tiers"] = {t.name: t.pages for t in stats.tiers}
    view["reuse"] = stats.reuse.to_dict() if stats.reuse is not None else None
    return decode_previews(view, decode) if decode is not None else view
