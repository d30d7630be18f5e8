"""The whole chain under pressure: device -> host RAM -> disk -> a real Redis, and back."""

import pytest
import torch

from tiered_cache.bench.redis_process import RedisServer
from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.spec import KVSpec
from tiered_cache.wire.codec import Codec, encode_page

SPEC = KVSpec("chain-test", 2, 2, 32, page_size=4)  # 2 KiB pages
PAGE = SPEC.bytes_per_page
PROMPT = 24  # tokens per prompt: 6 pages


def chain_cache(tmp_path, redis_url, prefix, codec="raw", **extra):
    cfg = CacheConfig(pool_capacity=8 * PAGE, host_capacity=8 * PAGE, lower_tiers=("disk", "redis"),
                      disk_path=str(tmp_path / "disk"), disk_capacity=12 * (PAGE + 200), redis_url=redis_url,
                      redis_prefix=prefix, codec=codec, codec_min_saving=0.0, **extra)
    return TieredCache(SPEC, cfg)


def prompts(n):
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        kv = torch.randn(SPEC.kv_shape(PROMPT), generator=gen)
        kv[:, :, :, :, :8] *= 0.01  # some structure, so the lossless codecs have something to find
        out.append((list(range(i * 1000, i * 1000 + PROMPT)), kv.half()))
    return out


@pytest.mark.parametrize("codec", list(Codec))
def test_fill_until_pages_reach_redis_then_get_everything_back(tmp_path, redis_server, redis_prefix, codec):
    cache = chain_cache(tmp_path, redis_server.url, f"{redis_prefix}-{codec.value}", codec=codec.value)
    data = prompts(10)  # 60 pages: 8 fit on the device, 8 in host RAM, ~12 on disk, the rest in Redis
    for tokens, kv in data:
        assert cache.put(tokens, kv) == PROMPT
        cache.check_integrity()
    assert cache.flush(timeout=60)  # demotion below host RAM is write-behind
    st = cache.stats()
    assert st.tier("device").evictions > 0 and st.tier("host").demotions > 0
    assert st.tier("disk").demotions > 0 and st.tier("redis").demotions > 0, "pages must reach Redis"
    assert st.tier("disk").evictions > 0
    for tokens, kv in reversed(data):  # newest first: device, then host, disk and Redis hits
        assert cache.lookup(tokens) == PROMPT
        n, got = cache.get(tokens)
        assert n == PROMPT
        if codec.lossy:
            err = (got.float() - kv.float()).abs()
            step = kv.float().abs().amax(dim=-1, keepdim=True) / 127
            assert (err <= step * 0.5 + kv.float().abs() * 2**-10 + 1e-6).all()
        else:
            assert torch.equal(got, kv), f"{codec.value}: KV came back different"
        cache.check_integrity()
    st = cache.stats()
    # Which lower tier serves a page depends on how far the write-behind demotions triggered by
    # these very reads have got; that pages came back up from below, byte-exact, is what matters.
    assert st.tier("redis").loads + st.tier("disk").loads > 0
    assert st.tier("host").loads > 0
    assert all(t.errors == 0 and t.corrupt == 0 for t in st.tiers)


def test_corrupt_and_foreign_blobs_below_are_misses_never_wrong_kv(tmp_path, redis_server, redis_prefix):
    cache = chain_cache(tmp_path, redis_server.url, redis_prefix)
    data = prompts(6)
    for tokens, kv in data:
        cache.put(tokens, kv)
    assert cache.flush(timeout=60)  # let the write-behind settle before tampering with the disk
    disk = cache.chain.tiers[0]
    # One victim page in each of two prompts (a bad page ends its prompt's prefix, hiding later ones).
    by_prompt = [[k for k in cache.core.keys("", t) if k in disk.index] for t, _ in data]
    victims = [keys[0] for keys in by_prompt if keys][:2]
    path = disk.file_of(victims[0])
    raw = bytearray(path.read_bytes())
    raw[300] ^= 0x40
    path.write_bytes(bytes(raw))
    # A blob of another model under the right key: the header's key matches, the fingerprint does not.
    other = SPEC.with_options(model_id="someone-else")
    disk.file_of(victims[1]).write_bytes(encode_page(torch.zeros(other.staging_shape(1)[1:]).half(), other,
                                                   victims[1]))
    for tokens, kv in data:
        n, got = cache.get(tokens)
        assert torch.equal(got, kv[:, :, :n])  # a shorter prefix at worst, never different bytes
    st = cache.stats()
    # Each bad blob is refused once, wherever it was when read: on disk, or in Redis if the disk's
    # eviction passed it down (the key in the foreign blob's header is right, only decoding fails).
    assert st.tier("disk").corrupt + st.tier("redis").corrupt == 2
    for key in victims:
        assert key not in disk.index and cache.chain.tiers[1].contains_prefix([key]) == 0


def test_redis_going_away_never_raises_into_put_or_get(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    cache = chain_cache(tmp_path, server.url, "down", redis_timeout_s=0.3)
    data = prompts(8)
    try:
        for tokens, kv in data[:4]:
            cache.put(tokens, kv)
        server.stop()
        for tokens, kv in data[4:]:
            assert cache.put(tokens, kv) == PROMPT  # demotion into Redis fails quietly
        for tokens, kv in data:
            n, got = cache.get(tokens)
            assert torch.equal(got, kv[:, :, :n])
        assert cache.stats().tier("redis").errors > 0
    finally:
        server.stop()
