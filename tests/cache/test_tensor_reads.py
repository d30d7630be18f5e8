"""The tensor API's `get`: pages in host RAM are copied once straight into the result (nothing is
loaded into the pool), pages on the device and in host RAM join in one result, and pages below
host RAM are read by their tier straight into the result, each checked there, a corrupt one
ending the prefix."""

from __future__ import annotations

import torch
from kv_oracle import token_kv

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import DType, KVSpec
from tiered_cache.tiers.disk import DiskTier
from tiered_cache.tiers.ram import RamTier

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


def stored_below(tokens: list[int], below: RamTier | DiskTier) -> None:
    writer = make([below], write_policy="write_through")
    writer.put(tokens, token_kv(SPEC, tokens))
    writer.flush()
    writer.close()


def test_pages_below_host_ram_go_straight_into_the_result_beside_host_rams():
    below = RamTier(1 << 20)
    tokens = list(range(100, 124))
    stored_below(tokens, below)
    reader = make([below])
    try:
        reader.put(tokens[:12], token_kv(SPEC, tokens[:12]))
        reader.evict()  # three pages in host RAM, the rest below
        handle = reader.match(tokens[:8])  # the first two back on the device
        reader.load(handle)
        reader.release(handle)
        assert reader.pool.usage().used_pages == 2 and len(reader.host.index) == 3
        out = torch.zeros(SPEC.kv_shape(26), dtype=SPEC.dtype.torch)
        n, kv = reader.get(tokens + [7, 7], out=out)
        assert n == 24 and torch.equal(kv, token_kv(SPEC, tokens)) and kv.data_ptr() == out.data_ptr()
        assert below.stats().hits == 3  # the last three pages, nothing loaded into the pool or host RAM
        assert reader.pool.usage().used_pages == 2 and len(reader.host.index) == 3
        assert reader.stats().tier("host").loads == 2 + 1  # the match's two, then the third page
        n, kv = reader.get(tokens)  # into a tensor of its own: the tier is read again
        assert n == 24 and torch.equal(kv, token_kv(SPEC, tokens)) and below.stats().hits == 6
        reader.check_integrity()
    finally:
        reader.close()


def test_a_page_below_that_is_corrupt_ends_the_prefix_and_its_row_stays_free(tmp_path):
    below = DiskTier(tmp_path / "disk", 1 << 20, fsync=False)
    tokens = list(range(200, 216))
    stored_below(tokens, below)
    third = below.file_of(list(below.index)[2])  # written in prefix order
    blob = bytearray(third.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # a flipped bit in the payload: its checksum no longer matches
    third.write_bytes(bytes(blob))
    reader = make([below])
    try:
        n, kv = reader.get(tokens)
        assert n == 8 and torch.equal(kv, token_kv(SPEC, tokens[:8]))  # the two pages before it
        assert below.stats().corrupt == 1 and not third.exists()  # counted and deleted
        reader.check_integrity()
    finally:
        reader.close()
