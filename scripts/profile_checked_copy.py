"""The one-pass copy + CRC-32C (tiered_cache/wire/checked_copy.py) in isolation: raw pages lying
in a read-only shared mapping (as in a store server's arena, each after a blob header) copied into
their pages of a layer-first CPU pool, checksummed, beside the two-pass fallback and a memcpy of
the same bytes (torch `copy_`, both buffers touched), on 1 and 2 threads, rounds interleaved.
Usage: python3 scripts/profile_checked_copy.py [--mib 256] [--layers 32] [--page-mib 2] [--rounds 9]"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tiered_cache.wire import checked_copy
from tiered_cache.wire.checked_copy import copy_crc, copy_crc_two_pass

HEADER = 116  # a raw blob's header for a 5-dimension page: payloads start off page alignment


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--page-mib", type=float, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    page = int(args.page_mib * 2**20)
    n = args.mib * 2**20 // page
    block = page // (2 * args.layers)
    stride = page + HEADER + 4
    fd = os.memfd_create("profile-checked-copy")
    try:
        os.ftruncate(fd, n * stride)
        with mmap.mmap(fd, n * stride) as writer:
            writer.write(os.urandom(2**20) * (n * stride // 2**20) + bytes(n * stride % 2**20))
        arena = mmap.mmap(fd, n * stride, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    whole = np.frombuffer(arena, dtype=np.uint8)
    sources = [whole[i * stride + HEADER:i * stride + HEADER + page] for i in range(n)]
    pool = np.ones((2, args.layers, n, block), dtype=np.uint8)
    dests = [pool[:, :, i].transpose(1, 0, 2) for i in range(n)]
    flat_src, flat_dst = torch.ones(n * page, dtype=torch.uint8), torch.zeros(n * page, dtype=torch.uint8)
    threads = ThreadPoolExecutor(2)

    def pages(way, share: range) -> None:
        for i in share:
            way(sources[i], dests[i])

    def on(count: int, way):
        return lambda: list(threads.map(lambda s: pages(way, range(s, n, count)), range(count)))

    cases = {"memcpy (torch copy_, its threads)": lambda: flat_dst.copy_(flat_src)}
    if checked_copy.NATIVE:
        cases |= {"copy_crc, 1 thread": on(1, copy_crc), "copy_crc, 2 threads": on(2, copy_crc)}
    cases |= {"two passes, 1 thread": on(1, copy_crc_two_pass), "two passes, 2 threads": on(2, copy_crc_two_pass)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(args.rounds + 1):
        for name, run in cases.items():
            started = time.perf_counter()
            run()
            if round_:  # the first round warms up
                times[name].append(time.perf_counter() - started)
    base = statistics.median(times["memcpy (torch copy_, its threads)"])
    print(f"{n} pages of {page / 2**20:.2f} MiB into a layer-first pool ({args.layers} layers, {block:,}-byte "
          f"blocks), median of {args.rounds} rounds; native: {checked_copy.NATIVE}")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:<36} {median * 1e3:8.1f} ms  {n * page / median / 1e9:6.2f} GB/s  {base / median:5.2f}x memcpy")


if __name__ == "__main__":
    main()
