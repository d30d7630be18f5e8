"""One vLLM prompt's worth of KV (36 pages of SmolLM2 fp32 layer groups, ~35 MB) fetched through
`RemoteTier` from a store server on this host: through its shared-memory ring (copied out, and
lent in place with a `ShmLease`, as the vLLM load job takes them) vs over the loopback gRPC
stream (`--shm 0`), alternating, median of 30 fetches each.

    .venv/bin/python scripts/bench_shm_fetch.py
"""

from __future__ import annotations

import statistics
import time

import torch

from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.spec import KVSpec
from tiered_cache.service.process import StoreProcess
from tiered_cache.service.shm_ring import ShmLease
from tiered_cache.tiers.codec import encode_page
from tiered_cache.tiers.memtune import tune_malloc
from tiered_cache.tiers.remote import RemoteTier


def main() -> None:
    tune_malloc()  # as TieredCache and the vLLM block store run
    spec = KVSpec("shm-bench", 5, 3, 64, page_size=128, dtype="fp32")
    keys = PageKeyer(spec).keys(list(range(spec.page_size * 36)))
    items = [(k, encode_page(torch.randn(spec.staging_shape(1)[1:]), spec, k, "raw")) for k in keys]
    megabytes = sum(len(b) for _, b in items) / 1e6
    for shm in ("256MiB", "0", "256MiB", "0"):
        with StoreProcess(["--no-disk", "--shm", shm]) as store:
            tier = RemoteTier([store.address])
            tier.put(items)
            for lend in (False, True) if shm != "0" else (False,):
                times = []
                for _ in range(30):
                    started = time.perf_counter()
                    got = tier.get(keys, lease=ShmLease() if lend else None)
                    times.append(time.perf_counter() - started)
                assert [bytes(b) for b in got] == [b for _, b in items]
                way = ("shared-memory ring, lent" if lend else "shared-memory ring, copied"
                       ) if tier.servers[0].client.uses_shm else "loopback gRPC stream"
                print(f"{way:27s} {megabytes:.1f} MB: median {1e3 * statistics.median(times):.1f} ms")
            tier.close()


if __name__ == "__main__":
    main()
