"""Making room on the request path costs only what the request needs: a device page a lower tier
already holds is dropped, not copied into host RAM; one no tier holds is copied down (never lost);
every page still loads back byte for byte."""

from __future__ import annotations

import torch
from kv_oracle import token_kv

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.tiers.ram import RamTier

SPEC = KVSpec("room-making-test", 2, 2, 8, dtype=DType.FP32, page_size=4)
PAGE = SPEC.bytes_per_page


def make(lower, **cfg) -> TieredCache:
    # No background demotion (high watermark 1.0): every eviction here is the request's own.
    config = CacheConfig(pool_capacity=8 * PAGE, host_capacity=16 * PAGE, malloc_tuning=False,
                         high_watermark=1.0, low_watermark=0.5, **cfg)
    return TieredCache(SPEC, config, lower=lower)


def load(cache: TieredCache, tokens: list[int]):
    handle = cache.match(tokens)
    try:
        return cache.load(handle)
    finally:
        cache.release(handle)


def test_a_full_pool_drops_pages_safe_below_and_copies_the_rest():
    below = RamTier(1 << 20)
    writer = make([below], write_policy="write_through")  # another instance stores prefix A below
    a = list(range(16))
    writer.put(a, token_kv(SPEC, a))
    writer.flush()
    writer.close()
    assert below.contains_prefix(writer.core.keys("", a)) == 4

    reader = make([below])
    try:
        assert len(load(reader, a)) == 4  # A from below: known there now
        b = list(range(100, 116))  # B computed here: in no tier
        reader.put(b, token_kv(SPEC, b))
        c = list(range(200, 216))
        reader.put(c, token_kv(SPEC, c))  # the pool (8 pages) is full: A (least recent) must go
        keys_a = reader.core.keys("", a)
        assert not any(k in reader.host.index for k in keys_a), "a page safe below was copied into host RAM"
        assert reader.stats().pool.uncopied_evictions == 4
        d = list(range(300, 316))
        reader.put(d, token_kv(SPEC, d))  # now B goes: no tier holds it, so host RAM gets a copy
        keys_b = reader.core.keys("", b)
        assert all(k in reader.host.index for k in keys_b)
        assert reader.stats().pool.uncopied_evictions == 4
        for tokens in (a, b):  # both still served, byte for byte: A from below, B from host RAM
            pages = load(reader, tokens)
            assert torch.equal(reader.pool.read_tokens(pages, 16), token_kv(SPEC, tokens))
        reader.check_integrity()
    finally:
        reader.close()


def test_without_a_lower_tier_every_evicted_page_is_copied_to_host_ram():
    cache = make([])
    try:
        prompts = [list(range(i * 100, i * 100 + 16)) for i in range(3)]
        for p in prompts:
            cache.put(p, token_kv(SPEC, p))
        assert cache.stats().pool.uncopied_evictions == 0
        assert all(k in cache.host.index for k in cache.core.keys("", prompts[0]))
        pages = load(cache, prompts[0])
        assert torch.equal(cache.pool.read_tokens(pages, 16), token_kv(SPEC, prompts[0]))
    finally:
        cache.close()
