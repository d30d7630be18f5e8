import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiered_cache.device.allocator import PageAllocator
from tiered_cache.errors import PageStateError, PoolExhaustedError

TOTAL = 24


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free against a set-of-used-pages model."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(TOTAL)
        self.used: set[int] = set()

    @rule(n=st.integers(0, TOTAL + 3))
    def allocate(self, n):
        if n > TOTAL - len(self.used):
            with pytest.raises(PoolExhaustedError) as info:
                self.alloc.allocate(n)
            assert info.value.needed == n and info.value.available == TOTAL - len(self.used)
            return
        pages = self.alloc.allocate(n).tolist()
        assert len(set(pages)) == n and not (set(pages) & self.used)
        self.used |= set(pages)

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
        assert self.alloc.num_used == len(self.used)
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
