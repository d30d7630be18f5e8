"""put/get GiB/s of N pages of 1 MiB through RedisTier: standalone vs a 3-master cluster, same run,
beside redis-py's own pipelined SET / MGET (standalone) and cluster pipeline SET / mget_nonatomic.

    .venv/bin/python scripts/bench_redis_cluster.py [PAGES=256] [ROUNDS=2]
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import redis
from tier_helpers import blobs_for

from tiered_cache.bench.redis_process import RedisClusterServers, RedisServer
from tiered_cache.model.spec import KVSpec
from tiered_cache.tiers.redis import RedisTier
from tiered_cache.tiers.redis_nodes import SOCKET_READ_SIZE

SPEC = KVSpec("bench", 2, 8, 64, page_size=256)  # 2 layers x K,V x 8 heads x 256 tokens x 64 x fp16 = 1 MiB


def rate(fn, total: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return total / best / 2**30


def tier_row(label: str, url: str, items: list, total: int) -> str:
    keys, blobs = [k for k, _ in items], [b for _, b in items]
    tier = RedisTier(url, prefix="bench", timeout_s=30)
    put, get = rate(lambda: tier.put(items), total), rate(lambda: tier.get(keys), total)
    assert tier.get(keys) == blobs and tier.stats().errors == 0, "lost or wrong pages"
    tier.close()
    return f"{label:22s} put {put:5.2f} GiB/s   get (verified) {get:5.2f} GiB/s"


def raw_row(label: str, client, cluster: bool, items: list, total: int) -> str:
    names = [b"raw:" + k.hex().encode() for k, _ in items]

    def put() -> None:
        pipe = client.pipeline(transaction=False)
        for name, (_, blob) in zip(names, items, strict=True):
            pipe.set(name, blob)
        pipe.execute()

    get = (lambda: client.mget_nonatomic(names)) if cluster else (lambda: client.mget(names))
    p, g = rate(put, total), rate(get, total)
    for name in names:
        client.delete(name)
    return f"{label:22s} put {p:5.2f} GiB/s   get            {g:5.2f} GiB/s"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    items = blobs_for(n, SPEC)
    total = sum(len(b) for _, b in items)
    print(f"{n} pages x {len(items[0][1]) / 2**20:.3f} MiB = {total / 2**20:.0f} MiB; best of 3 per figure")
    single = RedisServer(Path(tempfile.mkdtemp()), maxmemory="2gb")
    cluster = RedisClusterServers(Path(tempfile.mkdtemp()), masters=3, maxmemory="1gb")
    single.start()
    cluster.start()
    opts = {"socket_timeout": 30, "socket_read_size": SOCKET_READ_SIZE}
    try:
        for r in range(rounds):
            print(f"round {r + 1}/{rounds}", flush=True)
            print(tier_row("tier, standalone", single.url, items, total), flush=True)
            print(tier_row("tier, cluster (3 m.)", cluster.url, items, total), flush=True)
            print(raw_row("redis-py standalone", redis.Redis(port=single.port, **opts), False, items, total))
            print(raw_row("redis-py RedisCluster",
                          redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0], **opts), True, items, total))
    finally:
        single.stop()
        cluster.stop()


if __name__ == "__main__":
    main()
