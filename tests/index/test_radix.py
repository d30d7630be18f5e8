import numpy as np
import pytest

from tiered_cache.errors import StaleHandleError
from tiered_cache.index.eviction_queue import EvictionPolicy
from tiered_cache.index.keys import PageKeyer
from tiered_cache.index.radix import RadixTree
from tiered_cache.model.spec import KVSpec

SPEC = KVSpec("model", 1, 1, 1, page_size=2)
KEYS = PageKeyer(SPEC, "")


def pages(*tokens):
    return KEYS.keys(list(tokens))


def test_partial_match_splits_the_node_and_the_handle_covers_the_match():
    tree = RadixTree()
    tree.insert(pages(1, 1, 2, 2, 3, 3, 4, 4), [10, 11, 12, 13])
    assert tree.num_nodes == 1
    result = tree.match_prefix(pages(1, 1, 2, 2, 9, 9))
    assert result.num_pages == 2 and result.values.tolist() == [10, 11]
    assert tree.num_nodes == 2 and (result.node.start, result.node.end) == (0, 2)
    tree.lock(result.node)
    assert tree.size_info() == (2, 2)  # the tail stays evictable, the matched head is protected
    evicted = tree.evict(100)
    assert [e.values.tolist() for e in evicted] == [[12, 13]] and evicted[0].start == 2
    tree.unlock(result.node)
    assert tree.size_info() == (2, 0)
    tree.check_integrity()


def test_insert_reports_existing_pages_and_keeps_their_values():
    tree = RadixTree()
    tree.insert(pages(1, 1, 2, 2), [0, 1])
    result = tree.insert(pages(1, 1, 2, 2, 3, 3), [7, 8, 9])
    assert result.num_existing == 2
    assert tree.match_prefix(pages(1, 1, 2, 2, 3, 3)).values.tolist() == [0, 1, 9]
    with pytest.raises(ValueError, match="one value per page key: 1 keys, 2 values"):
        tree.insert(pages(5, 5), [1, 2])


def test_namespaces_never_share_nodes():
    tree = RadixTree()
    other = PageKeyer(SPEC, "tenant-b")
    tree.insert(pages(1, 1, 2, 2), [0, 1], namespace="")
    assert tree.match_prefix(pages(1, 1, 2, 2), namespace="tenant-b").num_pages == 0
    # Even the same key bytes under another namespace root do not match.
    assert tree.match_prefix(pages(1, 1), namespace="tenant-b").num_pages == 0
    tree.insert(other.keys([1, 1, 2, 2]), [5, 6], namespace="tenant-b")
    assert tree.match_prefix(other.keys([1, 1]), namespace="tenant-b").values.tolist() == [5]
    assert tree.namespaces() == ["", "tenant-b"] and tree.num_nodes == 3  # 1 + tenant-b split in 2


def test_lru_evicts_the_least_recently_used_leaf_first():
    tree = RadixTree(EvictionPolicy.LRU)
    for i in range(3):
        tree.insert(pages(i, i), [i])
    tree.match_prefix(pages(0, 0))  # 0 is now the most recent
    assert [e.values.tolist() for e in tree.evict(2)] == [[1], [2]]


def test_lfu_evicts_the_least_frequently_used_leaf_first():
    tree = RadixTree("lfu")
    for i in range(3):
        tree.insert(pages(i, i), [i])
    for _ in range(3):
        tree.match_prefix(pages(0, 0))
    tree.match_prefix(pages(2, 2))
    assert [e.values.tolist() for e in tree.evict(3)] == [[1], [2], [0]]


def test_parent_becomes_evictable_after_its_children():
    tree = RadixTree()
    tree.insert(pages(1, 1, 2, 2), [0, 1])
    tree.insert(pages(1, 1, 3, 3), [0, 2])  # splits: [1,1] -> {[2,2], [3,3]}
    evicted = tree.evict(3)
    assert sorted(e.values.tolist() for e in evicted) == [[0], [1], [2]]
    assert evicted[-1].values.tolist() == [0]  # the shared parent goes last
    assert tree.size_info().total == 0 and tree.num_nodes == 0


def test_locked_paths_survive_eviction_and_unlock_errors():
    tree = RadixTree()
    handle = tree.insert(pages(1, 1, 2, 2), [0, 1]).node
    tree.lock(handle)
    tree.lock(handle)
    assert tree.evict(10) == []
    tree.unlock(handle)
    assert tree.evict(10) == []  # still locked once
    tree.unlock(handle)
    with pytest.raises(ValueError, match="without a matching lock"):
        tree.unlock(handle)
    assert len(tree.evict(10)) == 1
    root = tree.match_prefix([]).node
    tree.lock(root)  # locking the root (an empty match) is a harmless no-op
    tree.unlock(root)
    tree.check_integrity()


def test_eviction_queue_stays_compact_under_many_hits():
    tree = RadixTree()
    for i in range(50):
        tree.insert(pages(i, i), [i])
    for n in range(20_000):
        tree.match_prefix(pages(n % 50, n % 50))
    queue = tree._queue
    assert len(queue._heap) <= 2 * queue.num_queued + 1024
    tree.check_integrity()
    assert [e.values.tolist()[0] for e in tree.evict(50)] == list(range(50))  # oldest hit first


def test_hundred_thousand_nodes_stay_consistent():
    rng = np.random.default_rng(0)
    tree = RadixTree()
    stored = []
    while tree.num_nodes < 100_000:
        base = stored[rng.integers(len(stored))] if stored else []
        seq = base[:rng.integers(len(base) + 1)] + [rng.bytes(32) for _ in range(3)]
        tree.insert(seq, range(len(seq)))
        stored.append(seq)
    tree.check_integrity()
    before = tree.size_info().total
    evicted = tree.evict(5000)
    assert sum(len(e.keys) for e in evicted) >= 5000
    assert tree.size_info().total == before - sum(len(e.keys) for e in evicted)
    tree.check_integrity()


def test_nodes_own_copies_of_exactly_their_values():
    tree = RadixTree()
    caller = np.arange(100, 104, dtype=np.int64)
    node = tree.insert(pages(1, 1, 2, 2, 3, 3, 4, 4), caller).node
    assert node.values.base is None and node.values.flags.owndata
    caller[:] = -1  # the caller reuses its array: the tree must not follow
    assert tree.match_prefix(pages(1, 1, 2, 2, 3, 3, 4, 4)).values.tolist() == [100, 101, 102, 103]
    head = tree.match_prefix(pages(1, 1, 2, 2)).node  # splits node after 2 pages
    assert head is not node and node.values.tolist() == [102, 103] and head.values.tolist() == [100, 101]
    for n in (head, node):
        assert n.values.base is None and n.values.flags.owndata and n.values.size == 2
    longer = np.arange(200, 206, dtype=np.int64)
    tail = tree.insert(pages(1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6), longer).node  # 4 existing pages
    assert tail.values.tolist() == [204, 205] and tail.values.base is None
    tree.check_integrity()


def test_evicted_handles_are_stale():
    tree = RadixTree()
    node = tree.insert(pages(1, 1, 2, 2), [0, 1]).node
    assert not node.is_root
    assert [e.values.tolist() for e in tree.evict(10)] == [[0, 1]]
    assert not node.is_root and node.removed
    tree.insert(pages(1, 1, 2, 2), [5, 6])  # the same tokens again: a new node, the old handle stays stale
    for call in (tree.lock, tree.unlock):
        with pytest.raises(StaleHandleError, match=r"evicted .* match the prefix again"):
            call(node)
    with pytest.raises(ValueError):  # StaleHandleError is a ValueError, as a bad unlock always was
        tree.unlock(node)
    assert tree.size_info() == (2, 0)
    tree.check_integrity()
    assert tree.match_prefix(pages(1, 1, 2, 2)).values.tolist() == [5, 6]


def test_a_split_node_is_still_a_valid_handle():
    tree = RadixTree()
    node = tree.insert(pages(1, 1, 2, 2, 3, 3), [0, 1, 2]).node
    tree.match_prefix(pages(1, 1, 9, 9))  # splits node into [1,1] -> [2,2,3,3]
    assert tree.num_nodes == 2 and not node.removed
    tree.lock(node)
    assert tree.size_info() == (0, 3)  # node and the new head above it are protected
    assert tree.evict(10) == []
    tree.unlock(node)
    tree.check_integrity()
    assert sorted(e.values.tolist() for e in tree.evict(10)) == [[0], [1, 2]]  # the head and the rest of node
