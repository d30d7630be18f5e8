"""`TieredCache` as a state machine against a brute-force model of which KV each token must carry.

Several handles live at once over a small pool (so eviction and write-behind demotion happen),
a small host tier and a small blob tier below (so pages go all the way down and come back).
Allocated pages are filled with poison before the engine writes, as stale memory would be: a
page committed without being written, or served for the wrong prefix, fails the byte checks.
`close` starts a fresh instance over the same lower tier, as another process sharing a store.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule
from kv_oracle import token_kv

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.errors import PoolExhaustedError
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.tiers.ram import RamTier

SPEC = KVSpec("machine-test", 1, 1, 4, dtype=DType.FP32, page_size=2)
PAGE = SPEC.bytes_per_page
TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=12)


class Request:
    def __init__(self, handle, target: list[int]) -> None:
        self.handle = handle
        self.target = target  # the tokens this request will write and commit


class CacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.below = RamTier(6 * (PAGE + 512))
        self.cache = self._new_cache()
        self.live: list[Request] = []

    def _new_cache(self) -> TieredCache:
        cfg = CacheConfig(pool_capacity=6 * PAGE, host_capacity=3 * PAGE, high_watermark=0.8, low_watermark=0.5,
                          malloc_tuning=False)
        return TieredCache(SPEC, cfg, lower=[self.below])

    def _expect(self, tokens: list[int], pages: np.ndarray) -> None:
        n = len(pages) * SPEC.page_size
        assert n <= len(tokens)
        got = self.cache.pool.read_tokens(pages, n)
        assert torch.equal(got, token_kv(SPEC, tokens[:n])), "served KV is not the KV of these tokens"

    @rule(target=requests, tokens=TOKENS, prefetch=st.booleans())
    def match(self, tokens, prefetch):
        handle = self.cache.match(tokens)
        assert handle.num_device_pages <= handle.available_pages <= len(tokens) // SPEC.page_size
        self._expect(tokens, handle.device_pages)
        if prefetch:
            self.cache.prefetch(handle)
        request = Request(handle, tokens)
        self.live.append(request)
        return request

    @rule(request=requests)
    def load(self, request):
        if request.handle.released or request.handle.own_pages:
            return
        pages = self.cache.load(request.handle)
        self._expect(request.target, pages)

    @rule(request=requests, n=st.integers(0, 8))
    def allocate(self, request, n):
        h = request.handle
        if h.released:
            return
        room = len(request.target) - h.prefix_tokens - h.own_tokens
        n = min(n, room)
        if n <= 0:
            return
        try:
            pages = self.cache.allocate(h, n)
        except PoolExhaustedError:
            return
        if len(pages):
            self.cache.pool.kv[:, :, torch.from_numpy(pages)] = torch.randn(2, 1, len(pages), 2, 1, 4)  # poison

    @rule(request=requests, k=st.integers(1, 8))
    def write(self, request, k):
        h = request.handle
        if h.released:
            return
        k = min(k, h.own_tokens - h.own_written)
        if k <= 0:
            return
        start = h.prefix_tokens + h.own_written
        self.cache.write(h, token_kv(SPEC, request.target[:start + k])[:, :, start:])

    @rule(request=requests, extra=st.integers(0, 3), explicit=st.booleans())
    def commit(self, request, extra, explicit):
        h = request.handle
        if h.released:
            return
        written = h.written_tokens
        if extra and written + extra <= len(request.target):
            with pytest.raises(ValueError, match="written"):
                self.cache.commit(h, request.target[:written + extra], written + extra if explicit else None)
            return
        tokens = request.target if explicit else request.target[:written]
        self.cache.commit(h, tokens, written if explicit else None)
        self._expect(request.target, h.device_pages)

    @rule(request=consumes(requests))
    def release(self, request):
        if not request.handle.released:
            self.cache.release(request.handle)
        self.live.remove(request)

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        self.cache.evict(n)

    @precondition(lambda self: not any(not r.handle.released for r in self.live))
    @rule()
    def close(self):
        self.cache.close()
        self.cache = self._new_cache()  # a fresh instance: only what reached the tier below survives

    @rule(tokens=TOKENS)
    def get(self, tokens):
        n, kv = self.cache.get(tokens)
        assert torch.equal(kv, token_kv(SPEC, tokens[:n]))

    @invariant()
    def integrity(self):
        self.cache.check_integrity()
        usage = self.cache.pool.usage()
        assert usage.free_pages + usage.used_pages == usage.total_pages

    def teardown(self):
        for request in self.live:
            if not request.handle.released:
                self.cache.release(request.handle)
        self.cache.close()


TestCacheMachine = CacheMachine.TestCase
