"""The reader side of `bench remote --netns` (netns_bench.py), run in the client's network
namespace: it fills both store servers with the run's prefixes (through the veth, as another
instance would), then times the serving rounds of `bench pool-load` against each, beside a raw TCP
stream of the same bytes, and a bare gRPC stream of them, and last a new reader process's first
loads from the bulk Get's server (`bench pool-load`'s first.py, in this namespace too); prints the
figures as JSON.

    python -m tiered_cache.bench.netns_reader JOB   # JOB: the JSON netns_bench.py writes
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from typing import Any


def read(job: dict[str, Any]) -> dict[str, Any]:
    """In the client namespace: fill the store, then the serving rounds beside the raw TCP stream,
    then the bare gRPC stream of the same bytes."""
    import socket

    import torch

    from tiered_cache.bench.pool_load.bench import FIRST_LOADS
    from tiered_cache.bench.pool_load.first import first_loads
    from tiered_cache.bench.pool_load.prefixes import Prefixes
    from tiered_cache.bench.pool_load.serving import serving_rounds
    from tiered_cache.bench.pool_load.sites import Site, Way, put_prefixes, serving_prefixes
    from tiered_cache.bench.raw_tcp import receive
    from tiered_cache.bench.remote_clients import raw_channel, raw_stream_request
    from tiered_cache.device.malloc import tune_malloc
    from tiered_cache.model.spec import KVSpec
    from tiered_cache.tiers.remote import RemoteTier
    from tiered_cache.wire.codec import raw_blob_size

    tune_malloc()
    prefixes = Prefixes(KVSpec.from_dict(job["spec"]), job["mib"])
    token = os.environ["TIERED_CACHE_SERVE_TOKEN"]
    serving = serving_prefixes(job["pool_prefixes"], job["rounds"])
    for store, count in ((job["store"], serving + FIRST_LOADS), (job["grpc_store"], serving)):
        writer = RemoteTier([store], token=token, timeout_s=60, fingerprint=bytes.fromhex(prefixes.spec.fingerprint))
        try:
            put_prefixes(writer.put, prefixes, count, f"the store server at {store}")
        finally:
            writer.close()
    blob = raw_blob_size(prefixes.spec)
    wire = prefixes.num_pages * blob
    host, port = job["tcp"].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    into = memoryview(torch.ones(wire, dtype=torch.uint8).numpy())  # touched, as the pool is

    receive(sock, into)  # the connection warmed, as the cache's are
    timed = {}
    for store in (job["store"], job["grpc_store"]):
        settings = _settings(store, token)
        site = Site("remote", "store server in another namespace -> pool",
                    "raw TCP stream, same bytes", settings, lambda _prefix: lambda: receive(sock, into))
        timed[store] = serving_rounds(site, prefixes, job["rounds"], job["pool_prefixes"])[site.way]  # engines' way
        gc.collect()  # that reader's pool and host RAM go now (its parts refer to each other), not beside the next
    sock.close()
    channel = raw_channel(job["grpc"])
    stream = channel.unary_stream("/raw.Raw/Stream")
    request = raw_stream_request(prefixes.num_pages, blob)
    grpc_s = []
    for _ in range(job["rounds"] + 1):
        started = time.perf_counter()
        kept = list(stream(request, timeout=120))
        grpc_s.append(time.perf_counter() - started)
        del kept
    channel.close()
    bulk = timed[job["store"]]
    first = first_loads(job["spec"], job["mib"], _settings(job["store"], token), "remote", serving, FIRST_LOADS,
                        job["settle_s"], Way.PREFETCH.value)
    return {"load_s": bulk.seconds, "grpc_load_s": timed[job["grpc_store"]].seconds, "raw_tcp_s": bulk.baseline_seconds,
            "bare_grpc_s": statistics.median(grpc_s[1:]), "wire_bytes": wire, "first_s": first.first_seconds,
            "steady_s": first.steady, "memcpy_first_over_steady": first.memcpy_first_over_steady}


def _settings(store: str, token: str) -> dict[str, Any]:
    """A reader cache's settings for `store` across the veth."""
    return {"lower_tiers": "remote", "remote_addresses": store, "remote_token": token, "remote_timeout_s": 60}


if __name__ == "__main__":
    print(json.dumps(read(json.loads(sys.argv[1]))))
