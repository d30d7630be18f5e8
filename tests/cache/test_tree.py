"""`TieredCache.prefix_tree()` and `tiered-cache tree`'s drawing: shared prefixes as one branch,
each continuation a child, pages, tokens, where, hits and text as the cache knows them."""

from __future__ import annotations

import torch

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import KVSpec
from tiered_cache.report.tree import render_tree

SPEC = KVSpec("tree-test", 2, 1, 8, page_size=4)
SHARED = list(range(100, 124))  # 6 pages


def _kv(n: int) -> torch.Tensor:
    return torch.randn(SPEC.kv_shape(n)).half()


def _cache(**config) -> TieredCache:
    return TieredCache(SPEC, CacheConfig(pool_capacity="1MiB", **config))


def test_a_shared_prefix_is_one_branch_and_each_continuation_a_leaf():
    with _cache() as cache:
        for tail in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]):
            cache.put(SHARED + tail, _kv(len(SHARED) + len(tail)))
        cache.get(SHARED + [9, 10, 11, 12])  # a hit on the second continuation
        view = cache.prefix_tree(decode=lambda ids: " ".join(map(str, ids)))
    (ns,) = view["namespaces"]
    (branch,) = ns["children"]
    assert (branch["pages"], branch["tokens"], branch["first_page"]) == (6, 24, 0)
    assert branch["head_tokens"] == SHARED[:4] and branch["tail_tokens"] == SHARED[-4:]
    assert branch["head_text"] == "100 101 102 103" and branch["where"] == ["device"]
    leaves = branch["children"]
    assert [leaf["pages"] for leaf in leaves] == [2, 1]  # the larger branch first
    assert leaves[0]["head_tokens"] == [1, 2, 3, 4] and leaves[1]["head_tokens"] == [9, 10, 11, 12]
    assert leaves[1]["hits"] == 1 and leaves[0]["hits"] == 0 and branch["hits"] >= 1
    assert all(leaf["children"] == [] and leaf["idle_s"] >= 0 and not leaf["in_use"] for leaf in leaves)
    assert view["nodes"] == 3 and not view["truncated"]


def test_where_names_the_tiers_that_hold_copies_and_namespaces_stay_apart(tmp_path):
    with _cache(write_policy="write_through", lower_tiers=["disk"], disk_path=str(tmp_path)) as cache:
        cache.put(SHARED, _kv(len(SHARED)))
        cache.put(SHARED, _kv(len(SHARED)), namespace="tenant-b")
        cache.flush(30)
        view = cache.prefix_tree()
    assert [ns["namespace"] for ns in view["namespaces"]] == ["", "tenant-b"]
    for ns in view["namespaces"]:
        (node,) = ns["children"]
        assert node["where"] == ["device", "host", "disk"] and node["pages"] == 6
        assert "head_text" not in node  # no decoder given: token ids only


def test_the_drawing_shows_branches_and_a_bounded_tree_says_it_is_cut():
    with _cache() as cache:
        for first in range(5):
            cache.put(SHARED + [first] * 4, _kv(len(SHARED) + 4))
        text = render_tree(cache.prefix_tree(decode=lambda ids: f"t{ids[0]}"))
        cut = cache.prefix_tree(max_nodes=3)
    lines = text.splitlines()
    assert lines[0] == "namespace (default): 1 branch from the root"
    assert lines[1].startswith("└── 6 pages (24 tokens) · device · hits ") and '"t100" … "t120"' in lines[1]
    assert sum(line.startswith("    ├── 1 page (4 tokens)") for line in lines) == 4
    assert sum(line.startswith("    └── 1 page (4 tokens)") for line in lines) == 1
    assert cut["truncated"] and len(cut["namespaces"][0]["children"][0]["children"]) == 2
    assert "raise --max-nodes" in render_tree(cut)
    assert "the tree is empty" in render_tree({"namespaces": [], "nodes": 0, "truncated": False})


def test_leaves_that_part_inside_a_page_show_where_they_part():
    # Two prompts that share the first two tokens of a page, then differ: two leaves whose first
    # pages start alike. Each leaf's text starts where they part, so the drawing tells them apart.
    with _cache() as cache:
        for tail in ([1, 2, 3, 4], [1, 2, 7, 8]):
            cache.put(SHARED + tail, _kv(len(SHARED) + len(tail)))
        view = cache.prefix_tree(decode=lambda ids: " ".join(map(str, ids)))
    (branch,) = view["namespaces"][0]["children"]
    leaves = sorted(branch["children"], key=lambda leaf: leaf["head_tokens"])
    assert [leaf["head_skipped_tokens"] for leaf in leaves] == [2, 2]
    assert [leaf["head_text"] for leaf in leaves] == ["3 4", "7 8"]
    assert branch["head_skipped_tokens"] == 0 and branch["head_text"] == "100 101 102 103"  # no sibling
    drawing = render_tree(view)
    assert '"…3 4"' in drawing and '"…7 8"' in drawing
