import signal
import time

import redis as redis_py
from tier_helpers import blobs_for

from tiered_cache.bench.redis_process import RedisServer
from tiered_cache.tiers.breaker import BreakerPolicy
from tiered_cache.tiers.redis import RedisTier

FAST_PROBE = BreakerPolicy(cooldown_s=0.05, max_cooldown_s=0.2)  # a dead server is asked again soon


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


def test_a_large_get_is_checked_part_by_part_and_every_bad_blob_is_a_miss(redis_server, redis_prefix):
    """42 keys asked come as 4 MGETs of 11; the first three parts are checked on a helper thread while
    the next arrives, the last on the caller's. A bad blob in any part is a miss, counted, deleted."""
    tier = RedisTier(redis_server.url, prefix=redis_prefix)
    items = blobs_for(40)
    keys = [k for k, _ in items]
    tier.put(items)
    raw = redis_py.Redis.from_url(redis_server.url)
    name = lambda k: f"{redis_prefix}:{k.hex()}".encode()  # noqa: E731
    bad = {0: items[0][1][:-1], 15: items[16][1], 39: b"garbage"}  # first part, a middle one, the last
    for i, blob in bad.items():
        raw.set(name(keys[i]), blob)
    raw.delete(name(keys[22]))  # and one missing
    asked = keys + keys[:2]  # a key asked twice is answered at both positions
    got = tier.get(asked)
    expected = [None if i in bad or i == 22 else b for i, (_, b) in enumerate(items)] + [None, items[1][1]]
    assert got == expected
    assert tier.stats().corrupt == 3 + 1  # keys[0] asked twice: found bad at both positions
    assert not any(raw.exists(name(keys[i])) for i in bad)
    tier.close()


def test_redis_down_then_back(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    tier = RedisTier(server.url, prefix="updown", timeout_s=0.5, breaker=FAST_PROBE)
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


def test_a_hung_redis_costs_one_timeout_then_the_breaker_answers(tmp_path):
    """SIGSTOPped Redis: takes connections, answers nothing. One call spends one timeout on it
    (no retry of a timeout), then the breaker answers misses at once until a probe finds Redis
    back."""
    server = RedisServer(tmp_path)
    server.start()
    tier = RedisTier(server.url, prefix="hung", timeout_s=0.3, breaker=FAST_PROBE)
    items = blobs_for(2)
    keys = [k for k, _ in items]
    assert tier.put(items) == 2
    server.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert tier.get(keys) == [None, None]
        assert time.monotonic() - started < 1.0, "a timeout must not be retried inside the call"
        stats = tier.stats()
        address = f"127.0.0.1:{server.port}"
        assert (stats.open_breakers, stats.breaker_trips, stats.breakers) == (1, 1, {address: "open"})
        started = time.monotonic()
        for _ in range(50):
            assert tier.get(keys) == [None, None]
        assert time.monotonic() - started < 0.5 + 0.3 * 4, "an open breaker answers without asking Redis"
    finally:
        server.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while tier.get(keys) != [b for _, b in items]:
        assert time.monotonic() < deadline, "the probe did not close the breaker once Redis answered"
        time.sleep(0.05)
    assert tier.stats().breakers == {address: "closed"}
    server.stop()


def test_a_restarted_redis_is_used_by_the_first_call_after_it(tmp_path):
    """Every pooled connection of a restarted Redis is broken: the first put after the restart
    reconnects inside the call, stores, and counts no error (no breaker trip)."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        tier = RedisTier(server.url, prefix="restart", timeout_s=1.0)
        items = blobs_for(3)
        assert tier.put(items) == 3
        server.stop()
        server.start()
        assert tier.put(items) == 3
        assert tier.get([k for k, _ in items]) == [b for _, b in items]
        assert tier.stats().errors == 0 and tier.stats().breaker_trips == 0
    finally:
        server.stop()


def test_an_unbounded_redis_reports_its_host_s_memory_as_capacity_and_its_pages(tmp_path):
    """maxmemory 0 is Redis's "no limit": the tier's capacity is then what Redis can grow to (its
    host's memory), never 0 B, and its pages are the keys it holds."""
    from tiered_cache.bench.redis_process import RedisServer

    server = RedisServer(tmp_path, maxmemory="0")
    server.start()
    try:
        tier = RedisTier(server.url, prefix="unbounded")
        tier.put(blobs_for(4))
        s = tier.stats()  # its first: INFO and DBSIZE asked now
        total = int(redis_py.Redis.from_url(server.url).info("memory")["total_system_memory"])
        assert s.capacity_bytes == total > 0 and s.pages == 4
        tier.close()
    finally:
        server.stop()
