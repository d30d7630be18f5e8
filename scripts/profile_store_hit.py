"""Where a same-host store hit's load goes, stage by stage: a prefix put into a store server on
this host (its arena), then, from a client's pool, the arena Lookup (`arena_pages`), the CRC
checks alone on 1..8 threads, the copies alone (`ArenaCopier._copy`: one DMA per run of blobs
into the chunk buffer, payloads scattered into pool pages), and the whole `to_pool` with each
thread count, straight from the map and staged through pinned host chunks (what a platform that
refuses the map's registration gets), beside a pinned host->device copy (CUDA) or a memcpy (CPU) of the same bytes.
Usage: python3 scripts/profile_store_hit.py [--model llama-3.1-8b] [--tokens 8192] [--device cuda]"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tiered_cache.bench.gpu_model import model_config
from tiered_cache.device.arena_copy import ArenaCopier
from tiered_cache.device.pool import PagePool
from tiered_cache.index.keys import PageKeyer
from tiered_cache.model.hf_config import spec_from_hf_config
from tiered_cache.server.process import StoreProcess
from tiered_cache.tiers.remote import RemoteTier
from tiered_cache.wire.codec import encode_page, verify_raw_blob


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_s(fn, device: str, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat + 1):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    spec = spec_from_hf_config(model_config(args.model), model_id=f"profile-{args.model}", dtype="bf16",
                               page_size=16)
    n = args.tokens // spec.page_size
    nbytes = n * spec.bytes_per_page
    keys = PageKeyer(spec, "profile").keys(list(range(n * spec.page_size)))
    page = torch.randn(spec.staging_shape(1), generator=torch.Generator().manual_seed(0)).to(spec.dtype.torch)
    print(f"{args.model}: {n} pages of {spec.bytes_per_page / 2**20:.2f} MiB = {nbytes / 2**30:.2f} GiB "
          f"on {args.device}")
    with StoreProcess(["--no-disk", "--ram", f"{2 * nbytes + 2**26}B"]) as store:
        tier = RemoteTier([store.address])
        pool = PagePool(spec, n, device=args.device)
        try:
            for start in range(0, n, 64):  # put in batches: each blob encoded once, ~128 MiB a call
                tier.put([(k, encode_page(page[0] + i, spec, k)) for i, k in enumerate(keys[start:start + 64])])
            tier.warm()
            print(f"same host: {tier.same_host}")
            lookup = median_s(lambda: tier.arena_pages(keys), "cpu")
            where = tier.arena_pages(keys)
            assert all(w is not None for w in where), "pages not in the arena"
            targets = pool.allocate(n)
            rows = [("arena_pages (Lookup of every key)", lookup, None)]
            views = [(k, arena.view(pos, length)) for k, (arena, pos, length) in zip(keys, where, strict=True)]
            for threads in (1, 2, 4, 8):
                with ThreadPoolExecutor(threads) as pool_threads:
                    seconds = median_s(lambda: list(pool_threads.map(lambda kv: verify_raw_blob(kv[1], spec, kv[0]),
                                                                     views)), "cpu")
                rows.append((f"CRC checks alone, {threads} threads", seconds, nbytes))
            for _, view in views:
                view.release()
            copier = ArenaCopier(pool, checkers=2)
            registered = copier.usable(where[0][0])
            rows.append((f"copies alone (arena registered: {registered})",
                         median_s(lambda: copier._copy(where, targets), args.device), nbytes))
            copier.close()
            for threads in (2, 4, 8):
                copier = ArenaCopier(pool, checkers=threads)
                copier.usable(where[0][0])
                rows.append((f"to_pool, {threads} CRC threads",
                             median_s(lambda c=copier: c.to_pool(keys, where, targets), args.device), nbytes))
                copier.close()
            for threads in (2, 4, 8):  # what a platform that refuses the registration gets
                copier = ArenaCopier(pool, checkers=threads, direct=False)
                copier.to_pool(keys, where, targets)  # its host chunks made and touched
                before = copier.figures()
                rows.append((f"to_pool staged (pinned host chunks), {threads} threads",
                             median_s(lambda c=copier: c.to_pool(keys, where, targets), args.device), nbytes))
                # Of which, a mean over those calls: the threads' copies into host chunks (with their
                # checks), and the copy stream (DMA and scatter; on the CPU the scatter alone).
                f = {k: v - before[k] for k, v in copier.figures().items() if k in ("calls", "check_s", "copy_s")}
                rows.append((f"  its threads' copies+checks, {threads} threads", f["check_s"] / f["calls"], nbytes))
                rows.append((f"  its copy stream, {threads} threads", f["copy_s"] / f["calls"], nbytes))
                copier.close()
            if args.device == "cuda":
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                rows.append(("pinned host->device copy", median_s(lambda: dev.copy_(host, non_blocking=True), "cuda"),
                             nbytes))
            else:
                a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
                rows.append(("memcpy", median_s(lambda: b.copy_(a), "cpu"), nbytes))
            for name, seconds, size in rows:
                rate = f"{size / seconds / 1e9:8.2f} GB/s" if size else ""
                print(f"  {name:<45} {seconds * 1e3:9.2f} ms {rate}")
        finally:
            tier.close()


if __name__ == "__main__":
    main()
