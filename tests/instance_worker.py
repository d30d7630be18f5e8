"""One inference instance in its own process, for the two-instance reuse test.

    python instance_worker.py put ADDRESS WORKDIR   # instance A: compute (random) KV, cache it
    python instance_worker.py get ADDRESS WORKDIR   # instance B: empty cache, load it from the store into its pool
    python instance_worker.py get-metrics ADDRESS WORKDIR  # B serving /metrics; prints, then waits
                                                           # for stdin to close (the test scrapes)
"""

import json
import sys
from pathlib import Path

import torch

from tiered_cache.cache import TieredCache
from tiered_cache.config import CacheConfig
from tiered_cache.model.presets import get_preset

SPEC = get_preset("smollm2-135m").spec
TOKENS = list(range(5000, 5000 + 1000))  # 62 full pages of 16 tokens and 8 tokens left over


def main() -> None:
    role, address, workdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    metrics = {"metrics_port": 0} if role == "get-metrics" else {}
    cache = TieredCache(SPEC, CacheConfig(pool_capacity="64MiB", host_capacity="64MiB", lower_tiers=["remote"],
                                          remote_addresses=[address], write_policy="write_through", **metrics))
    if role == "put":
        kv = torch.randn(SPEC.kv_shape(len(TOKENS)), generator=torch.Generator().manual_seed(1)).half()
        stored = cache.put(TOKENS, kv)
        cache.close()  # finishes the background write-through to the store
        torch.save(kv, workdir / "kv_a.pt")
        print(json.dumps({"stored": stored}))
        return
    before = cache.stats().tier("remote").loads
    n = cache.lookup(TOKENS)
    handle = cache.match(TOKENS)  # as an engine reuses a prefix: into its pool, kept there
    pages = cache.load(handle)
    got_n = len(pages) * SPEC.page_size
    kv = cache.pool.read_tokens(pages, got_n)
    cache.release(handle)
    reference = torch.load(workdir / "kv_a.pt")
    st = cache.stats()
    print(json.dumps({"lookup": n, "got": got_n, "identical": bool(torch.equal(kv, reference[:, :, :got_n])),
                      "remote_loads": st.tier("remote").loads - before,
                      "remote_hits": st.tier("remote").hits, "device_hits": st.tier("device").hits,
                      "remote_bytes_out": st.tier("remote").bytes_out, "device_pages": st.tier("device").pages,
                      "metrics_url": cache.metrics.url if cache.metrics else None}), flush=True)
    if cache.metrics:
        sys.stdin.read()  # scraped meanwhile
    cache.close()


if __name__ == "__main__":
    main()
