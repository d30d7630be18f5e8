from collections import Counter

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiered_cache.device.allocator import PageAllocator, has_duplicates
from tiered_cache.errors import IntegrityError, PageStateError, PoolExhaustedError

TOTAL = 24


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free/pin/unpin against a model: the set of used pages and a pin count per page.
    A page is free exactly when it is neither used nor pinned."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(TOTAL)
        self.used: set[int] = set()
        self.pins: Counter[int] = Counter()

    def pending(self):
        return {p for p, n in self.pins.items() if n > 0} - self.used

    def num_free(self):
        return TOTAL - len(self.used) - len(self.pending())

    @rule(n=st.integers(0, TOTAL + 3))
    def allocate(self, n):
        if n > self.num_free():
            with pytest.raises(PoolExhaustedError) as info:
                self.alloc.allocate(n)
            assert info.value.needed == n and info.value.available == self.num_free()
            return
        pages = self.alloc.allocate(n).tolist()
        assert len(set(pages)) == n and not (set(pages) & (self.used | self.pending())), "handed out a held page"
        self.used |= set(pages)

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def pin(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.used)), min_size=1, max_size=4))  # repeats too
        self.alloc.pin(np.array(pages))
        self.pins.update(pages)

    @precondition(lambda self: +self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        held = sorted((+self.pins).elements())
        pages = data.draw(st.lists(st.sampled_from(range(len(held))), unique=True, min_size=1))
        pages = [held[i] for i in pages]  # a sub-multiset of the pins held
        self.alloc.unpin(pages)
        self.pins.subtract(pages)

    @rule(data=st.data())
    def bad_pin_or_unpin_changes_nothing(self, data):
        not_used = sorted(set(range(TOTAL)) - self.used)  # free or pending
        if not_used:
            with pytest.raises(PageStateError, match="are free"):
                self.alloc.pin([data.draw(st.sampled_from(not_used))])
        page = data.draw(st.integers(0, TOTAL - 1))
        with pytest.raises(PageStateError, match="without a matching pin"):
            self.alloc.unpin([page] * (self.pins[page] + 1))

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def free_some(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.used)), unique=True, min_size=1))
        self.alloc.free(np.array(pages))
        self.used -= set(pages)

    @rule(data=st.data())
    def bad_free_changes_nothing(self, data):
        free = sorted(set(range(TOTAL)) - self.used)
        choices = [[-1], [TOTAL]]
        if free:
            choices.append([data.draw(st.sampled_from(free))])  # double free / never allocated
        if self.used:
            page = data.draw(st.sampled_from(sorted(self.used)))
            choices.append([page, page])  # repeated within one call
        with pytest.raises(PageStateError):
            self.alloc.free(data.draw(st.sampled_from(choices)))

    @invariant()
    def consistent(self):
        self.alloc.check_integrity()
        assert self.alloc.num_free + self.alloc.num_used == TOTAL
        assert self.alloc.num_free == self.num_free()
        assert self.alloc.num_pending == len(self.pending())
        assert self.alloc.num_used == len(self.used) + len(self.pending())
        assert set(np.flatnonzero(self.alloc.in_use).tolist()) == self.used


TestAllocatorMachine = AllocatorMachine.TestCase


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive integer"):
        PageAllocator(0)
    alloc = PageAllocator(4)
    with pytest.raises(ValueError, match="non-negative integer"):
        alloc.allocate(-1)
    with pytest.raises(PageStateError, match="flat sequence of integers"):
        alloc.free([0.5])
    alloc.allocate(4)
    with pytest.raises(PoolExhaustedError, match="evict at least 1 pages"):
        alloc.allocate(1)


def test_a_page_freed_while_pinned_is_free_after_its_last_unpin():
    alloc = PageAllocator(4)
    pages = alloc.allocate(3)
    alloc.pin(pages[:2])
    alloc.pin(pages[:1])
    alloc.free(pages)  # page 2 is free now; pages 0 and 1 wait for their pins
    assert (alloc.num_free, alloc.num_pending, alloc.num_used) == (2, 2, 2)
    assert sorted(alloc.allocate(2).tolist()) == [2, 3]  # never a pending page
    with pytest.raises(PoolExhaustedError):
        alloc.allocate(1)
    with pytest.raises(PageStateError, match="double free"):
        alloc.free(pages[:1])  # a pending page is not the caller's any more
    with pytest.raises(PageStateError, match="are free"):
        alloc.pin(pages[:1])  # nor can it be pinned again
    alloc.unpin(pages[:2])
    assert (alloc.num_free, alloc.num_pending) == (1, 1) and alloc.allocate(1).tolist() == [1]
    with pytest.raises(PageStateError, match=r"without a matching pin\(\) on pages \[0\]"):
        alloc.unpin([0, 0])  # page 0 holds one pin; nothing changes
    alloc.unpin(pages[:1])
    assert (alloc.num_free, alloc.num_pending) == (1, 0)
    alloc.check_integrity()


def test_unpinning_a_used_page_keeps_it_used():
    alloc = PageAllocator(2)
    pages = alloc.allocate(2)
    alloc.pin(pages)
    alloc.unpin(pages)
    assert alloc.num_free == 0 and alloc.in_use.all()
    alloc.free(pages)
    assert alloc.num_free == 2
    alloc.check_integrity()


def test_integrity_check_catches_a_pinned_page_in_the_free_list():
    alloc = PageAllocator(2)
    alloc._pins[0] = 1  # simulate a bug: a free page with a pin
    with pytest.raises(IntegrityError, match="pinned page is in the free list"):
        alloc.check_integrity()


def test_has_duplicates_agrees_with_a_set():
    rng = np.random.default_rng(3)
    for size in (0, 1, 2, 7, 300):
        for high in (2, 50, 10_000):
            arr = rng.integers(0, high, size)
            assert has_duplicates(arr) == (len(set(arr.tolist())) != size), (size, high)
