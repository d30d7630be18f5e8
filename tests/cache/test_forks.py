"""Copy-on-write forks: `TieredCache.fork`, page holder counts, the copy on first write.

A state machine forks, writes, commits, swaps out and in, releases and evicts several live sequences over a small
pool against a brute-force model (each sequence must read back exactly the KV of its own
tokens); unit tests pin the page accounting: forks store shared pages once, a write copies one
page, a release frees only what no one else holds, and `check_integrity` catches a wrong count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from kv_oracle import token_kv

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.errors import IntegrityError, PoolExhaustedError, SwapError
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.tiers.ram import RamTier

SPEC = KVSpec("fork-test", 1, 1, 4, dtype=DType.FP32, page_size=4)
PAGE = SPEC.bytes_per_page
SUFFIX = st.lists(st.integers(0, 3), min_size=0, max_size=10)


def small_cache(pages: int = 16, host_pages: int = 4, lower=None) -> TieredCache:
    cfg = CacheConfig(pool_capacity=pages * PAGE, host_capacity=host_pages * PAGE, high_watermark=0.9,
                      low_watermark=0.6, malloc_tuning=False)
    return TieredCache(SPEC, cfg, lower=lower if lower is not None else [])


def pages_of(handle) -> np.ndarray:
    return np.concatenate([handle.device_pages, np.array(handle.own_pages, dtype=np.int64)])


def read_back(cache: TieredCache, handle) -> torch.Tensor:
    return cache.pool.read_tokens(pages_of(handle), handle.written_tokens)


def started(cache: TieredCache, tokens: list[int]):
    """A handle that has allocated and written `tokens` (none cached before)."""
    handle = cache.match(tokens)
    cache.allocate(handle, len(tokens))
    cache.write(handle, token_kv(SPEC, tokens))
    return handle


def test_forks_share_every_page_until_one_writes_then_copy_only_that_page():
    cache = small_cache()
    prompt = list(range(10))  # 2 full pages + 2 tokens in a third
    parent = started(cache, prompt)
    used = cache.pool.usage().used_pages
    forks = cache.fork(parent, 4)
    assert cache.pool.usage().used_pages == used == 3  # the prompt's pages are held once
    assert cache.stats().pool.shared_pages == 3 and cache.stats().pool.forks == 4
    cache.check_integrity()
    for i, fork in enumerate(forks):
        cache.allocate(fork, 1)  # room left in the shared last page: nothing allocated
        cache.write(fork, token_kv(SPEC, [*prompt, 100 + i])[:, :, -1:])
        assert fork.own_pages[:2] == parent.own_pages[:2] and fork.own_pages[2] != parent.own_pages[2]
        assert torch.equal(read_back(cache, fork), token_kv(SPEC, [*prompt, 100 + i]))
    assert cache.pool.usage().used_pages == used + 4  # one copied page per fork, no more
    assert cache.stats().pool.cow_copies == 4
    assert torch.equal(read_back(cache, parent), token_kv(SPEC, prompt))  # the parent's page untouched
    cache.check_integrity()
    cache.release(parent)
    assert cache.pool.usage().used_pages == used + 3  # only the parent's private last page went
    for fork in forks:
        cache.release(fork)
    assert cache.pool.usage().used_pages == 0
    cache.check_integrity()
    cache.close()


def test_committed_forks_insert_shared_pages_once_and_the_tree_keeps_them():
    cache = small_cache()
    prompt = list(range(9))
    parent = started(cache, prompt)
    a, b = cache.fork(parent, 2)
    cache.release(parent)
    for fork, token in ((a, 7), (b, 8)):
        cache.allocate(fork, 3)
        cache.write(fork, token_kv(SPEC, [*prompt, token, token, token])[:, :, 9:])
    assert cache.commit(a, [*prompt, 7, 7, 7]) == 12  # three full pages, the first two shared with b
    assert cache.commit(b, [*prompt, 8, 8, 8]) == 4  # only its own third page is new
    cache.check_integrity()
    cache.release(a)
    cache.release(b)
    for token in (7, 8):
        n, kv = cache.get([*prompt, token, token, token])
        assert n == 12 and torch.equal(kv, token_kv(SPEC, [*prompt, token, token, token]))
    assert cache.pool.usage().used_pages == cache.tree.size_info().total == 4
    cache.check_integrity()
    cache.close()


def test_engine_writes_through_writable_slots_and_mark_written_refuses_a_shared_page():
    cache = small_cache()
    parent = started(cache, [1, 2, 3, 4, 5, 6])
    (fork,) = cache.fork(parent, 1)
    cache.allocate(fork, 2)
    with pytest.raises(ValueError, match="writable_slots"):
        cache.mark_written(fork, 1)  # the engine would have written into the parent's page
    slots = cache.writable_slots(fork, 2)
    assert len(slots) == 2 and slots[0] // SPEC.page_size not in parent.own_pages
    kv = token_kv(SPEC, [1, 2, 3, 4, 5, 6, 9, 9])
    cache.pool.write(slots, kv[:, :, 6:])
    cache.mark_written(fork, 2)
    assert torch.equal(read_back(cache, fork), kv)
    assert torch.equal(read_back(cache, parent), token_kv(SPEC, [1, 2, 3, 4, 5, 6]))
    for h in (parent, fork):
        cache.release(h)
    cache.check_integrity()
    cache.close()


def test_fork_rejects_bad_counts_and_dead_handles():
    cache = small_cache()
    handle = started(cache, [1, 2, 3])
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="positive number of forks"):
            cache.fork(handle, bad)
    cache.release(handle)
    with pytest.raises(ValueError, match="already released"):
        cache.fork(handle, 2)
    assert cache.pool.usage().used_pages == 0
    cache.close()


def test_a_copy_on_write_that_finds_the_pool_full_fails_cleanly():
    cache = small_cache(pages=3)
    parent = started(cache, list(range(10)))  # all 3 pages, none evictable (not committed)
    (fork,) = cache.fork(parent, 1)
    cache.allocate(fork, 1)
    with pytest.raises(PoolExhaustedError):
        cache.write(fork, token_kv(SPEC, [*range(10), 5])[:, :, -1:])
    assert fork.own_written == parent.own_written == 10 and fork.own_pages == parent.own_pages
    cache.check_integrity()
    cache.release(fork)
    cache.release(parent)
    cache.check_integrity()
    cache.close()


def test_check_integrity_catches_a_wrong_holder_count():
    cache = small_cache()
    handle = started(cache, [1, 2, 3, 4, 5])
    cache.pool.share([handle.own_pages[0]])  # a holder nobody knows of: the page would leak
    with pytest.raises(IntegrityError, match="holders"):
        cache.check_integrity()
    cache.pool.free([handle.own_pages[0]])
    cache.check_integrity()
    cache.pool.free([handle.own_pages[1]])  # a holder missing: a fork could lose its page
    with pytest.raises(IntegrityError, match="holders"):
        cache.check_integrity()
    cache.close()


class Sequence:
    def __init__(self, handle, target: list[int]) -> None:
        self.handle = handle
        self.target = target  # this sequence's tokens: what it has written and will write


class ForkMachine(RuleBasedStateMachine):
    """Several live sequences, forked from each other, over an 8-page pool with host RAM and a
    tier below: each must always read back the KV of exactly its own written tokens."""

    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.cache = small_cache(pages=8, host_pages=3, lower=[RamTier(8 * (PAGE + 512))])
        self.live: list[Sequence] = []

    @rule(target=sequences, tokens=SUFFIX)
    def start(self, tokens):
        handle = self.cache.match(tokens)
        self.cache.load(handle)
        sequence = Sequence(handle, tokens)
        self.live.append(sequence)
        return sequence

    @rule(sequence=sequences, n=st.integers(0, 6))
    def allocate(self, sequence, n):
        h = sequence.handle
        if h.released or h.swapped:
            return
        n = min(n, len(sequence.target) - h.prefix_tokens - h.own_tokens)
        if n > 0:
            try:
                pages = self.cache.allocate(h, n)
            except PoolExhaustedError:
                return
            if len(pages):  # poison, as stale memory would be
                self.cache.pool.kv[:, :, torch.from_numpy(pages)] = torch.randn(2, 1, len(pages), 4, 1, 4)

    @rule(sequence=sequences, k=st.integers(1, 6))
    def write(self, sequence, k):
        h = sequence.handle
        if h.released or h.swapped:
            return
        k = min(k, h.own_tokens - h.own_written)
        if k <= 0:
            return
        start = h.written_tokens
        try:
            self.cache.write(h, token_kv(SPEC, sequence.target[:start + k])[:, :, start:])
        except PoolExhaustedError:  # no page for the copy-on-write: nothing may have changed
            assert h.written_tokens == start

    @rule(target=sequences, sequence=sequences, n=st.integers(1, 3), suffixes=st.lists(SUFFIX, min_size=3, max_size=3))
    def fork(self, sequence, n, suffixes):
        h = sequence.handle
        if h.released or h.swapped:
            return sequence  # hypothesis needs a value; a released one does nothing later
        children = self.cache.fork(h, n)
        written = sequence.target[:h.written_tokens]
        made = [Sequence(child, written + suffix) for child, suffix in zip(children, suffixes, strict=False)]
        self.live.extend(made)
        return made[0]

    @rule(sequence=sequences)
    def commit(self, sequence):
        h = sequence.handle
        if not h.released and not h.swapped:
            self.cache.commit(h, sequence.target[:h.written_tokens])

    @rule(sequence=sequences)
    def swap(self, sequence):
        """Preempt a sequence (its pages to host RAM) or load it back: its bytes must survive."""
        h = sequence.handle
        if h.released:
            return
        if h.swapped is None:
            pages = np.array(h.own_pages, dtype=np.int64)
            try:
                self.cache.swap_out(h)
            except SwapError:  # host RAM full: nothing may have changed
                assert h.swapped is None
                return
            freed = torch.from_numpy(pages[~self.cache.pool.allocator.in_use[pages]])
            if len(freed):  # as the next request would overwrite them
                self.cache.pool.kv[:, :, freed] = torch.randn(2, 1, len(freed), 4, 1, 4)
        else:
            try:
                self.cache.swap_in(h)
            except (SwapError, PoolExhaustedError):  # no room, or its prefix is gone: still swapped
                assert h.swapped is not None

    @rule(sequence=consumes(sequences))
    def release(self, sequence):
        if not sequence.handle.released:
            self.cache.release(sequence.handle)

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        self.cache.evict(n)

    @invariant()
    def each_sequence_reads_its_own_tokens(self):
        for sequence in self.live:
            h = sequence.handle
            if not h.released and not h.swapped:
                got = read_back(self.cache, h)
                assert torch.equal(got, token_kv(SPEC, sequence.target[:h.written_tokens])), \
                    "a sequence reads KV another fork wrote"

    @invariant()
    def integrity(self):
        self.cache.check_integrity()

    def teardown(self):
        for sequence in self.live:
            if not sequence.handle.released:
                self.cache.release(sequence.handle)
        self.cache.flush()
        self.cache.check_integrity()
        assert self.cache.pool.usage().used_pages == self.cache.tree.size_info().total
        self.cache.close()


TestForkMachine = ForkMachine.TestCase
