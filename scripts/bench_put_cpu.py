"""CPU per MiB that a Put costs each side, client and store server, on one host.

Puts `--rounds` batches of 32 SmolLM2 pages (360 KiB each, already encoded) into a fresh
`tiered-cache serve` process through `RemoteTier`, `--step` pages per put (the engine's
write-behind puts about 1 MiB at a time: 2-3 pages), and reads both processes' CPU time.
Extra arguments go to `serve` (`--shm 0` sends bytes over the gRPC stream instead of the
client's shared-memory ring; `--ram 256MiB` measures a store that is full and evicting):

    .venv/bin/python scripts/bench_put_cpu.py [--step N] [--rounds N] [serve args ...]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import time
from pathlib import Path

import numpy as np

from tiered_cache.model.presets import preset_spec
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.codec import encode_page


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=2, help="pages per put (default 2)")
    parser.add_argument("--rounds", type=int, default=60, help="batches of 32 pages (default 60)")
    args, serve_args = parser.parse_known_args()
    spec = preset_spec("smollm2-135m", page_size=16)
    pages = [np.random.default_rng(i).integers(0, 255, spec.bytes_per_page, dtype=np.uint8) for i in range(32)]
    batches = [[(key := hashlib.sha256(f"{r}-{j}".encode()).digest(), encode_page(pages[j], spec, key))
                for j in range(32)] for r in range(args.rounds)]
    mib = args.rounds * 32 * len(batches[0][0][1]) / 2**20
    with StoreProcess(serve_args or ["--no-disk", "--ram", "2GiB"]) as store:
        assert store.proc is not None
        tier = RemoteTier([store.address])
        tier.put(batches[0][:1])  # connected (and the ring offered) before timing
        server0, client0, wall0 = process_cpu_s(store.proc.pid), own_cpu_s(), time.perf_counter()
        for batch in batches:
            for i in range(0, len(batch), args.step):
                tier.put(batch[i:i + args.step])
        server1, client1, wall1 = process_cpu_s(store.proc.pid), own_cpu_s(), time.perf_counter()
        ring = tier.servers[0].client.uses_shm_put
        tier.close()
    print(f"{mib:,.0f} MiB in puts of {args.step} pages ({'client ring' if ring else 'bytes over gRPC'}): "
          f"wall {wall1 - wall0:.2f} s, server CPU {1e3 * (server1 - server0) / mib:.2f} ms/MiB, "
          f"client CPU {1e3 * (client1 - client0) / mib:.2f} ms/MiB")


if __name__ == "__main__":
    main()
