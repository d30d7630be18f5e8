"""Random operations on RadixTree against a brute-force model, with check_integrity() after each."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiered_cache.errors import StaleHandleError
from tiered_cache.index.eviction_queue import EvictionPolicy
from tiered_cache.index.keys import PageKeyer
from tiered_cache.index.radix import RadixTree
from tiered_cache.model.spec import KVSpec

PAGE = 2
KEYERS = {ns: PageKeyer(KVSpec("model", 1, 1, 1, page_size=PAGE), ns) for ns in ("", "b")}
# A 2-letter alphabet and short sequences make shared prefixes, splits and re-inserts common.
sequences = st.lists(st.integers(0, 1), min_size=0, max_size=6 * PAGE + 1).map(tuple)
namespaces = st.sampled_from(sorted(KEYERS))


class RadixModel(RuleBasedStateMachine):
    """The model holds the set of cached page-aligned prefixes, each with its value, last access
    time and hit count; `check_integrity()` runs after every step through the invariant."""

    policy = EvictionPolicy.LRU

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(self.policy)
        self.values: dict[tuple, int] = {}  # (ns, prefix) -> value; its keys are what is cached
        self.access: dict[tuple, int] = {}
        self.hits: dict[tuple, int] = {}
        self.by_key: dict[bytes, tuple] = {}
        self.locks: list[tuple] = []  # (handle, [(ns, prefix), ...])
        # Every non-empty match handle, locked or not, with its last page; a handle is stale exactly
        # when that page was evicted after the match (a live handle's node holds its last page).
        self.handles: list[list] = []  # [handle, prefixes, evicted?]
        self.clock = 0
        self.next_value = 0

    # --- helpers -------------------------------------------------------------------------------
    def prefixes(self, ns, tokens):
        keys = KEYERS[ns].keys(list(tokens))
        out = []
        for i, key in enumerate(keys):
            entry = (ns, tokens[:(i + 1) * PAGE])
            self.by_key[key] = entry
            out.append(entry)
        return keys, out

    def brute_force_match(self, prefixes):
        n = 0
        while n < len(prefixes) and prefixes[n] in self.values:
            n += 1
        return n

    def protected(self):
        return {p for _, held in self.locks for p in held}

    def evictable_leaves(self):
        protected = self.protected()
        present = set(self.values)
        parents = {(ns, prefix[:-PAGE]) for ns, prefix in present}
        return [p for p in present if p not in parents and p not in protected]

    def priority(self, entry):
        if self.policy is EvictionPolicy.LRU:
            return self.access[entry]
        return (self.hits[entry], self.access[entry])

    # --- rules ---------------------------------------------------------------------------------
    @rule(ns=namespaces, tokens=sequences)
    def insert(self, ns, tokens):
        keys, prefixes = self.prefixes(ns, tokens)
        expected_existing = self.brute_force_match(prefixes)
        values = list(range(self.next_value, self.next_value + len(keys)))
        self.next_value += len(keys)
        result = self.tree.insert(keys, values, ns)
        assert result.num_existing == expected_existing
        self.clock += 1
        for prefix, value in zip(prefixes, values, strict=True):
            self.values.setdefault(prefix, value)
            self.hits.setdefault(prefix, 0)
            self.access[prefix] = self.clock

    @rule(ns=namespaces, tokens=sequences, lock=st.booleans())
    def match(self, ns, tokens, lock):
        keys, prefixes = self.prefixes(ns, tokens)
        expected = self.brute_force_match(prefixes)
        result = self.tree.match_prefix(keys, ns)
        assert result.num_pages == expected
        assert result.values.tolist() == [self.values[p] for p in prefixes[:expected]]
        self.clock += 1
        for prefix in prefixes[:expected]:
            self.access[prefix] = self.clock
            self.hits[prefix] += 1
        if expected:
            self.handles.append([result.node, prefixes[:expected], False])
        if lock and expected:
            self.tree.lock(result.node)
            self.locks.append((result.node, prefixes[:expected]))

    @precondition(lambda self: self.handles)
    @rule(index=st.integers(0, 1000))
    def lock_old_handle(self, index):
        """Lock a handle from some earlier match: it works unless its node was evicted since."""
        handle, prefixes, evicted = self.handles[index % len(self.handles)]
        if evicted:
            with pytest.raises(StaleHandleError):
                self.tree.lock(handle)
            with pytest.raises(StaleHandleError):
                self.tree.unlock(handle)
        else:
            self.tree.lock(handle)
            self.locks.append((handle, prefixes))

    @precondition(lambda self: self.locks)
    @rule(index=st.integers(0, 1000))
    def unlock(self, index):
        handle, _ = self.locks.pop(index % len(self.locks))
        self.tree.unlock(handle)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages):
        protected = self.protected()
        freed = 0
        for node in self.tree.evict(num_pages):
            entries = [self.by_key[k] for k in node.keys]
            assert all(e in self.values and e not in protected for e in entries), "evicted a locked page"
            leaf = entries[-1]
            candidates = self.evictable_leaves()
            assert leaf in candidates, "evicted a node that still has cached children"
            assert self.priority(leaf) <= min(self.priority(c) for c in candidates), "not the lowest priority"
            assert node.values.tolist() == [self.values[e] for e in entries]
            assert node.start == len(entries[0][1]) // PAGE - 1
            for e in entries:  # a page inserted again later starts afresh, with no hits
                del self.values[e], self.hits[e], self.access[e]
            for h in self.handles:
                h[2] = h[2] or h[1][-1] in entries
            freed += len(entries)
        if freed < num_pages:
            assert not self.evictable_leaves(), "stopped early with pages still evictable"

    # --- invariants ----------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        self.tree.check_integrity()
        info = self.tree.size_info()
        protected = self.protected()
        assert info.total == len(self.values)
        assert info.protected == len(protected)
        assert info.evictable == len(self.values) - len(protected)


class LFURadixModel(RadixModel):
    policy = EvictionPolicy.LFU


TestRadixLRU = RadixModel.TestCase
TestRadixLFU = LFURadixModel.TestCase
