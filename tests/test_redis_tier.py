import time

import redis as redis_py
from tier_helpers import blobs_for

from tiered_cache.tiers.redis import RedisTier
from tiered_cache.tiers.redis_process import RedisServer


def test_round_trip_prefix_and_ttl(redis_server, redis_prefix):
    tier = RedisTier(redis_server.url, prefix=redis_prefix)
    items = blobs_for(5)
    keys = [k for k, _ in items]
    assert tier.put(items[:3]) == 3
    assert tier.contains_prefix(keys) == 3
    assert tier.get(keys) == [b for _, b in items[:3]] + [None, None]
    s = tier.stats()
    assert (s.hits, s.misses, s.errors) == (3, 2, 0) and s.bytes_in == sum(len(b) for _, b in items[:3])
    raw = redis_py.Redis.from_url(redis_server.url)
    assert raw.exists(f"{redis_prefix}:{keys[0].hex()}".encode())
    short = RedisTier(redis_server.url, prefix=redis_prefix + "-ttl", ttl_s=0.2)
    short.put(items[:1])
    assert short.contains_prefix(keys) == 1
    time.sleep(0.4)
    assert short.contains_prefix(keys) == 0
    tier.delete(keys)
    assert tier.contains_prefix(keys) == 0


def test_corrupt_blobs_in_redis_are_misses_and_deleted(redis_server, redis_prefix):
    tier = RedisTier(redis_server.url, prefix=redis_prefix)
    items = blobs_for(3)
    tier.put(items)
    raw = redis_py.Redis.from_url(redis_server.url)
    name = lambda k: f"{redis_prefix}:{k.hex()}".encode()  # noqa: E731
    raw.set(name(items[0][0]), items[0][1][:-3])  # truncated
    raw.set(name(items[1][0]), items[2][1])  # another page's blob
    assert tier.get([k for k, _ in items]) == [None, None, items[2][1]]
    assert tier.stats().corrupt == 2
    assert not raw.exists(name(items[0][0])) and not raw.exists(name(items[1][0]))


def test_redis_down_then_back(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    tier = RedisTier(server.url, prefix="updown", timeout_s=0.5, max_backoff_s=0.2)
    items = blobs_for(2)
    keys = [k for k, _ in items]
    assert tier.put(items) == 2
    server.stop()
    started = time.monotonic()
    for _ in range(20):  # nothing raises, every answer is a miss
        assert tier.get(keys) == [None, None]
        assert tier.contains_prefix(keys) == 0
        assert tier.put(items) == 0
    assert time.monotonic() - started < 5, "calls to a dead Redis must fail fast"
    assert tier.stats().errors >= 1
    server.start()
    try:
        deadline = time.monotonic() + 5
        while tier.put(items) == 0:
            assert time.monotonic() < deadline, "the tier did not recover after Redis came back"
            time.sleep(0.05)
        assert tier.get(keys) == [b for _, b in items]
    finally:
        server.stop()


def test_stats_asks_redis_at_most_once_a_second(tmp_path):
    server = RedisServer(tmp_path)  # its own server: DBSIZE counts only this test's pages
    server.start()
    try:
        raw = redis_py.Redis.from_url(server.url)
        tier = RedisTier(server.url, prefix="info")
        # Counted through DBSIZE, which stats() sends with its INFO (counting INFO would count ours).
        calls = lambda: int(raw.info("commandstats").get("cmdstat_dbsize", {}).get("calls", 0))  # noqa: E731
        before = calls()
        assert tier.stats().pages == 0
        tier.put(blobs_for(4))
        for _ in range(20):  # a dashboard polling in a loop
            assert tier.stats().pages == 0  # the figure of the last ask, not a new INFO
        assert calls() - before == 1
        time.sleep(1.1)
        assert tier.stats().pages == 4 and calls() - before == 2
        tier.close()
    finally:
        server.stop()
