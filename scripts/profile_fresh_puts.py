"""Puts into a store server whose arena is fresh: each Put's wall time, from the first (memory
never written: page faults and zeroing) to those after the arena's log came round once.

Puts `--batches` batches of 256 pages of 1 MiB (llama-3.1-8b, 8 tokens a page; fresh keys each
batch, encoded before timing) through one same-host `StoreClient` (its put ring) into
`tiered-cache serve --no-disk --ram RAM`:

    .venv/bin/python scripts/profile_fresh_puts.py [--ram 600MiB] [--batches 8]
"""

from __future__ import annotations

import argparse
import time

from tiered_cache.bench.remote_bench import _blobs
from tiered_cache.client.store_client import StoreClient
from tiered_cache.model.presets import preset_spec
from tiered_cache.server.process import StoreProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ram", default="600MiB")
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    spec = preset_spec("llama-3.1-8b").with_options(page_size=8)
    batches = [_blobs(spec, 256, f"put-{i}") for i in range(args.batches)]
    mib = sum(len(b) for _, b in batches[0]) / 2**20
    with StoreProcess(["--no-disk", "--ram", args.ram]) as store, StoreClient(store.address, timeout_s=120) as client:
        for batch in batches:
            started = time.perf_counter()
            reply = client.put(batch)
            seconds = time.perf_counter() - started
            print(f"stored {reply.stored} pages ({mib:,.0f} MiB) in {seconds * 1e3:,.0f} ms: "
                  f"{mib / 1024 / seconds:.2f} GiB/s (put ring: {client.uses_shm_put})")


if __name__ == "__main__":
    main()
