"""The Redis tier on a real 3-master Redis Cluster (`redis_cluster`, one per module): pages spread
over the masters, corrupt blobs are misses, and a master that hangs (SIGSTOP) or dies (SIGKILL)
costs only its own pages and at most a timeout per call. Those tests put the master back after."""

import threading
import time

import pytest
import redis as redis_py
from redis.crc import key_slot
from tier_helpers import blobs_for

from tiered_cache.bench.redis_process import free_port
from tiered_cache.tiers.breaker import BreakerPolicy
from tiered_cache.tiers.redis import RedisTier
from tiered_cache.tiers.redis_url import parse_cluster_url

FAST_PROBE = BreakerPolicy(cooldown_s=0.05, max_cooldown_s=0.2)  # a dead server is asked again soon

# The tier's timeout in the kill test is 0.5 s: a call may spend it once or twice, never a retry loop.
CALL_BOUND_S = 3.0


def name(prefix: str, key: bytes) -> bytes:
    return f"{prefix}:{key.hex()}".encode()


def raw_nodes(cluster) -> list[redis_py.Redis]:
    return [redis_py.Redis(port=port) for port in cluster.ports]


def slot_owners(cluster) -> dict[int, int]:
    """Slot -> index of the master that serves it, as the cluster itself reports."""
    owners = {}
    for start, end, (_, port, *_), *_ in raw_nodes(cluster)[0].execute_command("CLUSTER SLOTS"):
        owners.update(dict.fromkeys(range(start, end + 1), cluster.ports.index(port)))
    return owners


def bounded(fn, *args):
    started = time.monotonic()
    result = fn(*args)
    elapsed = time.monotonic() - started
    assert elapsed < CALL_BOUND_S, f"{fn.__name__} took {elapsed:.2f} s with a master down"
    return result


def test_cluster_urls():
    assert parse_cluster_url("redis://127.0.0.1:6379/0") is None
    assert parse_cluster_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7001") == (
        [("10.0.0.1", 7000), ("10.0.0.2", 7001)], {})
    assert parse_cluster_url("rediss+cluster://app:p%40ss@[::1]:7000/0") == (
        [("::1", 7000)], {"ssl": True, "username": "app", "password": "p@ss"})
    for bad in ("redis+cluster://", "redis+cluster://host", "redis+cluster://h:1,h", "redis+cluster://h:1/3"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)
    with pytest.raises(ValueError, match="hash tag"):
        RedisTier("redis+cluster://127.0.0.1:7000", prefix="{one-node}")


def test_unreachable_cluster_is_all_misses():
    tier = RedisTier(f"redis+cluster://127.0.0.1:{free_port()}", timeout_s=0.5)  # nothing listens there
    items = blobs_for(3)
    keys = [k for k, _ in items]
    started = time.monotonic()
    assert tier.put(items) == 0
    assert tier.get(keys) == [None] * 3 and tier.contains_prefix(keys) == 0
    tier.delete(keys)
    assert tier.stats().errors >= 1 and not tier.available
    assert time.monotonic() - started < CALL_BOUND_S
    tier.close()


def test_round_trip_spreads_pages_over_masters(redis_cluster, redis_prefix):
    nodes = raw_nodes(redis_cluster)
    before = [n.dbsize() for n in nodes]
    tier = RedisTier(redis_cluster.url, prefix=redis_prefix)
    items = blobs_for(64)
    keys = [k for k, _ in items]
    assert tier.put(items[:48]) == 48
    assert tier.contains_prefix(keys) == 48
    assert tier.get(keys) == [b for _, b in items[:48]] + [None] * 16
    added = [n.dbsize() - b for n, b in zip(nodes, before, strict=True)]
    assert sum(added) == 48 and all(count > 0 for count in added), f"pages per master: {added}"
    owners = slot_owners(redis_cluster)
    for key, _ in items[:48]:  # each page on the master of its own slot (no hash tag)
        assert nodes[owners[key_slot(name(redis_prefix, key))]].exists(name(redis_prefix, key))
    s = tier.stats()
    assert (s.hits, s.misses, s.errors) == (48, 16, 0)
    assert s.bytes_in == sum(len(b) for _, b in items[:48]) and s.bytes_out == s.bytes_in
    assert s.pages == sum(n.dbsize() for n in nodes) and s.capacity_bytes == 3 * 256 * 2**20
    short = RedisTier(redis_cluster.url, prefix=redis_prefix + "-ttl", ttl_s=0.2)
    assert short.put(items[:8]) == 8 and short.contains_prefix(keys) == 8
    time.sleep(0.4)
    assert short.contains_prefix(keys) == 0
    tier.delete(keys)
    assert tier.contains_prefix(keys) == 0 and [n.dbsize() for n in nodes] == before
    tier.close()
    short.close()


def test_corrupt_blobs_in_cluster_are_misses_and_deleted(redis_cluster, redis_prefix):
    tier = RedisTier(redis_cluster.url, prefix=redis_prefix)
    items = blobs_for(3)
    assert tier.put(items) == 3
    raw = redis_py.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    raw.set(name(redis_prefix, items[0][0]), items[0][1][:-3])  # truncated
    raw.set(name(redis_prefix, items[1][0]), items[2][1])  # another page's blob
    assert tier.get([k for k, _ in items]) == [None, None, items[2][1]]
    assert tier.stats().corrupt == 2
    assert not raw.exists(name(redis_prefix, items[0][0])) and not raw.exists(name(redis_prefix, items[1][0]))
    raw.close()
    tier.close()


def test_threads_share_a_cluster_tier(redis_cluster, redis_prefix):
    tier = RedisTier(redis_cluster.url, prefix=redis_prefix)
    wrong = []

    def worker(start: int) -> None:
        items = blobs_for(16, seed=start, start=start)
        for _ in range(5):
            stored = tier.put(items)
            got = tier.get([k for k, _ in items])
            if stored != 16 or got != [b for _, b in items]:
                wrong.append(start)

    threads = [threading.Thread(target=worker, args=(1000 * i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and tier.stats().errors == 0
    tier.close()


def test_hung_master_costs_a_timeout_not_a_hang(redis_cluster, redis_prefix):
    hung = 1
    owners = slot_owners(redis_cluster)
    tier = RedisTier(redis_cluster.url, prefix=redis_prefix, timeout_s=0.5, breaker=FAST_PROBE)
    items = blobs_for(96)
    keys = [k for k, _ in items]
    lost = [owners[key_slot(name(redis_prefix, k))] == hung for k in keys]
    assert tier.put(items) == 96
    redis_cluster.pause(hung)
    try:
        for _ in range(6):  # each call waits for the hung master at most once, the others answer
            assert bounded(tier.get, keys) == [None if gone else b for (_, b), gone in zip(items, lost, strict=True)]
            assert bounded(tier.put, items) == lost.count(False)
            time.sleep(0.1)
    finally:
        redis_cluster.resume(hung)
    assert tier.stats().errors >= 1
    deadline = time.monotonic() + 10
    while tier.put(items) != 96:
        assert time.monotonic() < deadline, "the tier did not use the resumed master again"
        time.sleep(0.05)
    assert tier.get(keys) == [b for _, b in items]
    tier.close()


def test_killed_master_costs_only_its_own_pages(redis_cluster, redis_prefix):
    victim = 0
    owners = slot_owners(redis_cluster)
    tier = RedisTier(redis_cluster.url, prefix=redis_prefix, timeout_s=0.5, breaker=FAST_PROBE)
    items, fresh = blobs_for(96), blobs_for(48, seed=1, start=10_000)
    keys, fresh_keys = [k for k, _ in items], [k for k, _ in fresh]
    on_victim = [owners[key_slot(name(redis_prefix, k))] == victim for k in keys + fresh_keys]
    lost, lost_fresh = on_victim[:96], on_victim[96:]
    assert any(lost) and not all(lost) and any(lost_fresh) and not all(lost_fresh)
    assert tier.put(items) == 96
    expected = [None if gone else b for (_, b), gone in zip(items, lost, strict=True)]

    redis_cluster.kill(victim)
    # Before the others notice (cluster-node-timeout), then once they flag it failed: without
    # `cluster-require-full-coverage no` every master would answer CLUSTERDOWN from then on.
    for phase in ("just killed", "flagged failed", "after the backoff"):
        if phase == "flagged failed":
            redis_cluster.wait_failed(victim)
        if phase == "after the backoff":
            time.sleep(0.3)  # past max_backoff_s: the tier asks the dead master again
        assert bounded(tier.get, keys) == expected, phase
        assert bounded(tier.contains, keys) == [not gone for gone in lost], phase
        assert bounded(tier.put, fresh) == lost_fresh.count(False), phase
        assert bounded(tier.get, fresh_keys) == [None if gone else b for (_, b), gone in
                                                 zip(fresh, lost_fresh, strict=True)], phase
        bounded(tier.delete, fresh_keys)
    s = bounded(tier.stats)
    assert s.errors >= 3 and s.pages == sum(n.dbsize() for i, n in enumerate(raw_nodes(redis_cluster)) if i != victim)

    redis_cluster.restart(victim)  # back, empty: its slots are served again
    deadline = time.monotonic() + 10
    while bounded(tier.put, items) != 96:
        assert time.monotonic() < deadline, "the tier did not use the restarted master again"
        time.sleep(0.05)
    assert tier.get(keys) == [b for _, b in items]
    tier.close()
