"""The tensor API's `get`: pages in host RAM are copied once straight into the result (nothing is
loaded into the pool), pages on the device and in host RAM join in one result, and pages below
host RAM are loaded into the pool first, so the next `get` asks the tier nothing."""

from __future__ import annotations

import torch
from kv_oracle import token_kv

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.tiers.memory import MemoryTier

SPEC = KVSpec("tensor-reads-test", 2, 2, 8, dtype=DType.FP16, page_size=4)
PAGE = SPEC.bytes_per_page


def make(lower=None, **cfg) -> TieredCache:
    config = CacheConfig(pool_capacity=16 * PAGE, host_capacity=32 * PAGE, malloc_tuning=False,
                         high_watermark=1.0, low_watermark=0.5, **cfg)
    return TieredCache(SPEC, config, lower=lower)


def test_pages_in_host_ram_go_straight_into_the_result_and_stay_there():
    cache = make()
    try:
        tokens = list(range(24))
        cache.put(tokens, token_kv(SPEC, tokens))
        assert cache.evict() == 6
        out = torch.zeros(SPEC.kv_shape(26), dtype=SPEC.dtype.torch)  # longer than the cached pages
        n, kv = cache.get(tokens + [900, 901], out=out)
        assert n == 24 and torch.equal(kv, token_kv(SPEC, tokens)) and kv.data_ptr() == out.data_ptr()
        assert cache.pool.usage().used_pages == 0  # nothing loaded into the pool
        assert cache.stats().tier("host").loads == 6
        n, kv = cache.get(tokens)  # again, into a tensor of its own
        assert n == 24 and torch.equal(kv, token_kv(SPEC, tokens))
        cache.check_integrity()
    finally:
        cache.close()


def test_a_prefix_partly_on_the_device_and_partly_in_host_ram_reads_whole():
    cache = make()
    try:
        head, tail = list(range(8)), list(range(8, 20))
        cache.put(head + tail, token_kv(SPEC, head + tail))
        cache.evict()
        handle = cache.match(head)  # the head back on the device, the tail left in host RAM
        cache.load(handle)
        cache.release(handle)
        assert cache.pool.usage().used_pages == 2
        n, kv = cache.get(head + tail)
        assert n == 20 and torch.equal(kv, token_kv(SPEC, head + tail))
        assert cache.pool.usage().used_pages == 2
    finally:
        cache.close()


def test_pages_below_host_ram_are_loaded_into_the_pool_so_the_next_get_asks_the_tier_nothing():
    below = MemoryTier(1 << 20)
    writer = make([below], write_policy="write_through")
    tokens = list(range(100, 116))
    writer.put(tokens, token_kv(SPEC, tokens))
    writer.flush()
    writer.close()
    reader = make([below])
    try:
        n, kv = reader.get(tokens)
        assert n == 16 and torch.equal(kv, token_kv(SPEC, tokens))
        hits = below.stats().hits
        assert hits == 4 and reader.pool.usage().used_pages == 4
        n, kv = reader.get(tokens)
        assert n == 16 and torch.equal(kv, token_kv(SPEC, tokens)) and below.stats().hits == hits
    finally:
        reader.close()
