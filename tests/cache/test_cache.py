import pytest
import torch

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig, WritePolicy
from tiered_cache.errors import KVShapeError, PoolExhaustedError
from tiered_cache.model.spec import DType, KVSpec

SPEC = KVSpec("cache-test", 2, 2, 16, page_size=4)
PAGE = SPEC.bytes_per_page


def cache(pool_pages=16, host_pages=16, **cfg):
    return TieredCache(SPEC, CacheConfig(pool_capacity=pool_pages * PAGE, host_capacity=host_pages * PAGE, **cfg))


def kv_for(n, seed=0, spec=SPEC):
    return torch.randn(spec.kv_shape(n), generator=torch.Generator().manual_seed(seed)).to(spec.dtype.torch)


def test_put_get_lookup_round_trip_off_page_boundary():
    c = cache()
    tokens, kv = list(range(100, 114)), kv_for(14)  # 3 full pages + 2 tokens
    assert c.lookup(tokens) == 0
    assert c.put(tokens, kv) == 12
    assert c.put(tokens, kv) == 0  # already cached
    assert c.lookup(tokens) == 12 and c.lookup(tokens[:9]) == 8
    n, got = c.get(tokens + [5, 6, 7])
    assert n == 12 and torch.equal(got, kv[:, :, :12])
    c.check_integrity()


def test_shared_prefixes_store_only_new_pages():
    c = cache()
    base, kv = list(range(16)), kv_for(24)
    c.put(base, kv[:, :, :16])
    other = base[:8] + list(range(500, 516))
    kv_other = torch.cat([kv[:, :, :8], kv_for(16, seed=1)], dim=2)
    assert c.put(other, kv_other) == 16  # two shared pages skipped
    n, got = c.get(other)
    assert n == 24 and torch.equal(got, kv_other)
    assert c.stats().tree_nodes == 3


def test_namespaces_are_separate():
    c = cache()
    tokens, kv = list(range(8)), kv_for(8)
    c.put(tokens, kv, namespace="tenant-a")
    assert c.lookup(tokens, namespace="tenant-b") == 0 and c.lookup(tokens) == 0
    assert c.lookup(tokens, namespace="tenant-a") == 8


def test_device_eviction_demotes_to_host_and_a_hit_loads_back():
    c = cache(pool_pages=4, host_pages=16, high_watermark=1.0)  # inline eviction only: exact counts
    seqs = [list(range(i * 100, i * 100 + 8)) for i in range(4)]
    kvs = [kv_for(8, seed=i) for i in range(4)]
    for s, kv in zip(seqs, kvs, strict=True):
        c.put(s, kv)
    st = c.stats()
    assert st.tier("device").evictions == 4 and st.tier("host").demotions == 4
    assert c.lookup(seqs[0]) == 8  # in host RAM only
    n, got = c.get(seqs[0])
    assert n == 8 and torch.equal(got, kvs[0])
    assert c.stats().tier("host").loads == 2
    c.check_integrity()


def test_write_through_copies_to_host_at_once():
    c = cache(write_policy=WritePolicy.WRITE_THROUGH)
    c.put(list(range(8)), kv_for(8))
    assert c.flush(timeout=30)  # the copy runs in the background, off the request path
    assert c.host.stats().pages == 2


def test_paged_api_lifecycle_and_fragmentation():
    c = cache(pool_pages=8)
    prompt, kv = list(range(10)), kv_for(10)
    c.put(prompt[:8], kv[:, :, :8])
    h = c.match(prompt)
    assert h.num_device_pages == 2
    prefix = c.load(h)
    assert len(prefix) == 2
    c.allocate(h, 2)  # tokens 8..9 go into one new page, 2 of 4 slots unused
    assert c.stats().pool.unused_slots == 2
    c.write(h, kv[:, :, 8:10])
    assert c.commit(h, prompt) == 0  # no new full page yet
    more = list(range(10, 16))
    kv_more = kv_for(6, seed=9)
    pages = c.allocate(h, 6)  # 2 more tokens fill page 3, 4 more go into page 4
    assert len(pages) == 1 and c.stats().pool.unused_slots == 0
    c.write(h, kv_more)
    full_kv = torch.cat([kv, kv_more], dim=2)
    assert c.commit(h, prompt + more) == 8
    c.release(h)
    assert c.stats().pool.unused_slots == 0 and c.pool.usage().used_pages == 4
    n, got = c.get(prompt + more)
    assert n == 16 and torch.equal(got, full_kv)
    with pytest.raises(ValueError, match="already released"):
        c.release(h)
    c.check_integrity()


def test_two_handles_loading_the_same_pages_do_not_leak():
    c = cache(pool_pages=4, host_pages=16)
    tokens, kv = list(range(8)), kv_for(8)
    c.put(tokens, kv)
    c.put(list(range(50, 58)), kv_for(8, 1))
    c.put(list(range(60, 68)), kv_for(8, 2))  # evicts the first prompt to host
    a, b = c.match(tokens), c.match(tokens)
    assert a.available_pages == b.available_pages == 2 and a.num_device_pages == 0
    pages_a = c.load(a)
    pages_b = c.load(b)  # the same pages again: B must end up with A's, its copies freed
    assert pages_a.tolist() == pages_b.tolist()
    c.release(a)
    c.release(b)
    c.check_integrity()
    assert c.pool.usage().used_pages == c.tree.size_info().total


def test_locked_prefix_is_never_evicted_and_exhaustion_is_an_error():
    c = cache(pool_pages=4, host_pages=4)
    tokens, kv = list(range(16)), kv_for(16)
    c.put(tokens, kv)
    h = c.match(tokens)
    assert c.put(list(range(100, 108)), kv_for(8)) == 0  # no room: nothing stored, nothing raised
    other = c.match(list(range(200, 208)))
    with pytest.raises(PoolExhaustedError):
        c.allocate(other, 8)  # the paged API says so: the engine must wait or preempt
    c.release(other)
    n, got = c.get(tokens)
    assert n == 16 and torch.equal(got, kv)  # the locked prefix is intact
    c.release(h)
    assert c.put(list(range(100, 108)), kv_for(8)) == 8
    c.check_integrity()


def test_bad_input_gets_clear_errors_and_changes_nothing():
    c = cache()
    tokens = list(range(8))
    with pytest.raises(KVShapeError, match=r"kv has shape \(2, 2, 7, 2, 16\), expected \(2, 2, 8, 2, 16\)"):
        c.put(tokens, kv_for(7))
    with pytest.raises(KVShapeError, match=r"dtype torch\.float32, expected torch\.float16"):
        c.put(tokens, kv_for(8).float())
    with pytest.raises(TypeError, match="tokens must be integers"):
        c.put([0.5] * 8, kv_for(8))
    with pytest.raises(TypeError, match="tokens must be integers"):
        c.lookup(["a", "b"])
    with pytest.raises(TypeError, match="namespace must be a str"):
        c.lookup(tokens, namespace=3)
    assert c.stats().tree_nodes == 0 and c.pool.usage().used_pages == 0
    with pytest.raises(ValueError, match="int8 codec needs"):
        TieredCache(SPEC.with_options(dtype=DType.FP8_E4M3), CacheConfig(codec="int8"))


def test_close_releases_lower_tier_connections(tmp_path):
    from tiered_cache.server.process import StoreProcess

    with StoreProcess(["--no-disk"]) as store:
        cfg = CacheConfig(pool_capacity=4 * PAGE, host_capacity=4 * PAGE, lower_tiers=["remote"],
                          remote_addresses=[store.address], write_policy="write_through")
        with TieredCache(SPEC, cfg) as c:
            c.put(list(range(8)), kv_for(8))
            assert c.flush(timeout=30)  # write-through runs in the background
            remote = c.chain.tiers[0]
            assert remote.contains_prefix(c.core.keys("", list(range(8)))) == 2
        assert remote._checker._shutdown  # the helper thread pool is gone
        assert remote.get(c.core.keys("", list(range(8)))) == [None, None]  # a closed tier only misses


def test_empty_and_sub_page_prompts_cache_nothing_and_return_empty_kv():
    c = cache()
    assert c.put([], kv_for(0)) == 0 and c.lookup([]) == 0
    n, kv = c.get([])
    assert n == 0 and kv.shape == SPEC.kv_shape(0)
    assert c.put([1, 2, 3], kv_for(3)) == 0  # less than one page: nothing is cached
    assert c.get([1, 2, 3])[0] == 0
    c.check_integrity()
