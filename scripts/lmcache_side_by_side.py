"""tiered-cache beside LMCache on the same bytes, each side in a fresh process: store a prefix's KV
to CPU RAM, retrieve it from CPU RAM, and retrieve it from a local disk, into an output buffer the
caller touched before (as an engine's KV memory is). Every retrieved byte is compared with what
was stored. Prints each side's median and ours against LMCache's speed.

LMCache is not a dependency of tiered-cache: install it beside, e.g.
    .venv/bin/pip install --target /tmp/lmc --no-deps lmcache==0.5.6 py-cpuinfo cachetools aiofile caio \
        msgspec pyzmq && .venv/bin/pip install --target /tmp/lmc numba
then: .venv/bin/python scripts/lmcache_side_by_side.py --lmcache-path /tmp/lmc

Each side: `--rounds` prefixes of `--mib` MiB of fp16 KV of the Llama-3.1-8B shape (32 layers,
8 KV heads of 128), each stored once and retrieved once (a prefix the reader never read).
- store to CPU RAM: LMCache `store` (chunks of 256 tokens copied into its CPU backend); ours the
  tensor API's `put` (pages copied into the pool, which on a CPU-only instance is CPU RAM).
- retrieve from CPU RAM: LMCache `retrieve` from its CPU backend; ours `get(out=)` with the pages
  in host RAM (the pool emptied into it).
- retrieve from disk: LMCache's local disk backend with its CPU copies cleared; ours a disk tier
  (no fsync, as LMCache's) with host RAM and the pool emptied. Both read files the OS caches.
LMCache runs through a connector of this script's (plain torch copies between its memory
objects and a CPU tensor): its own connectors need CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from tiered_cache.bench.timing import timed

LAYERS, HEADS, DIM = 32, 8, 128


def tokens_for(mib: int) -> int:
    return mib * 2**20 // (2 * LAYERS * HEADS * DIM * 2)


def ours(mib: int, where: str, rounds: int, folder: str) -> dict[str, Any]:
    import torch

    from tiered_cache.cache import TieredCache
    from tiered_cache.config import CacheConfig
    from tiered_cache.model.spec import KVSpec

    n = tokens_for(mib)
    spec = KVSpec("side-by-side", LAYERS, HEADS, DIM, dtype="fp16", page_size=16)
    room = (rounds + 2) * mib * 2**20
    settings: dict[str, Any] = dict(device="cpu", pool_capacity=room, host_capacity=room)
    if where == "disk":
        settings.update(lower_tiers=["disk"], disk_path=folder, disk_capacity=room, disk_fsync=False,
                        write_policy="write_through")
    cache = TieredCache(spec, CacheConfig(**settings))
    cache.warming.join()
    prefixes, src, out = _inputs(n, rounds, (LAYERS, 2, n, HEADS, DIM))
    stores, retrieves = [], []
    for tokens in prefixes:
        stores.append(timed(lambda t=tokens: cache.put(t, src), 1)[0])
        cache.evict()  # into host RAM (and, written through, on disk)
        cache.flush()
    if where == "disk":
        cache.host.delete(list(cache.host.index))
    for tokens in prefixes:
        out.zero_()
        seconds, (got, _) = timed(lambda t=tokens: cache.get(t, out=out), 1)
        if got != n or not torch.equal(out, src):
            raise SystemExit(f"ours: get gave {got} of {n} tokens, or wrong bytes")
        retrieves.append(seconds)
    cache.close()
    return {"store": stores, "retrieve": retrieves}


def lmcache(mib: int, where: str, rounds: int, folder: str) -> dict[str, Any]:
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    class CPUConnector(GPUConnectorInterface):  # KV_2LTD memory objects <-> a (2, layers, tokens, hidden) tensor
        def __init__(self) -> None:
            pass

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, LAYERS, num_tokens, HEADS * DIM])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kwargs["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end])

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(obj, start, end, **kwargs)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, start, end, **kwargs)

    n = tokens_for(mib)
    gib = (rounds + 2) * mib / 1024 + 1
    settings: dict[str, Any] = dict(chunk_size=256, local_cpu=True, max_local_cpu_size=gib)
    if where == "disk":
        settings.update(local_disk=f"file://{folder}/", max_local_disk_size=gib)
    config = LMCacheEngineConfig.from_defaults(**settings)
    metadata = LMCacheMetadata(model_name="side-by-side", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float16, kv_shape=(LAYERS, 2, 256, HEADS, DIM))
    engine = LMCacheEngineBuilder.get_or_create("side-by-side", config, metadata, CPUConnector(), None, None)
    engine.post_init()
    prefixes, src, out = _inputs(n, rounds, (2, LAYERS, n, HEADS * DIM))
    stores, retrieves = [], []
    for tokens in prefixes:
        stores.append(timed(lambda t=tokens: engine.store(torch.tensor(t), kvcaches=src), 1)[0])
    if where == "disk":
        time.sleep(2)  # its disk writes are asynchronous
        engine.storage_manager.clear(locations=["LocalCPUBackend"])
    for tokens in prefixes:
        out.zero_()
        seconds, mask = timed(lambda t=tokens: engine.retrieve(torch.tensor(t), kvcaches=out), 1)
        if int(mask.sum()) != n or not torch.equal(out, src):
            raise SystemExit(f"lmcache: retrieve gave {int(mask.sum())} of {n} tokens, or wrong bytes")
        retrieves.append(seconds)
    LMCacheEngineBuilder.destroy("side-by-side")
    return {"store": stores, "retrieve": retrieves}


def _inputs(n: int, rounds: int, shape: tuple[int, ...]) -> tuple[list[list[int]], Any, Any]:
    """Prefixes of random tokens, random fp16 KV, and an output buffer touched before."""
    import torch

    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(0, 50_000, (n,), generator=g).tolist() for _ in range(rounds)]
    src = torch.randn(shape, generator=g).half()
    out = src.clone()
    return prefixes, src, out


def side(args: argparse.Namespace) -> int:
    folder = tempfile.mkdtemp(prefix=f"side-by-side-{args.side}-")
    try:
        run = ours if args.side == "ours" else lmcache
        print(json.dumps(run(args.mib, args.where, args.rounds, folder)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="KV per prefix (default 256 MiB)")
    parser.add_argument("--rounds", type=int, default=7, help="prefixes per side (default 7)")
    parser.add_argument("--lmcache-path", help="a folder holding LMCache (added to its process's PYTHONPATH)")
    parser.add_argument("--side", choices=["ours", "lmcache"], help=argparse.SUPPRESS)
    parser.add_argument("--where", choices=["cpu", "disk"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return side(args)
    env = dict(os.environ, PYTHONHASHSEED="0")  # LMCache's builtin hash wants it set
    if args.lmcache_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.lmcache_path, env.get("PYTHONPATH")) if p)
    figures: dict[tuple[str, str], dict[str, list[float]]] = {}
    for where in ("cpu", "disk"):
        for who in ("lmcache", "ours"):
            run = subprocess.run([sys.executable, __file__, "--side", who, "--where", where, "--mib", str(args.mib),
                                  "--rounds", str(args.rounds)], env=env, capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"{who} ({where}) failed:\n{run.stderr[-3000:]}")
            figures[who, where] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{args.mib} MiB of fp16 KV (Llama-3.1-8B shape) per prefix, {args.rounds} prefixes per side, medians; "
          "ours / LMCache as speed (>1: ours faster)")
    rows = [("store to CPU RAM", "cpu", "store"), ("retrieve from CPU RAM", "cpu", "retrieve"),
            ("retrieve from disk", "disk", "retrieve")]
    for label, where, what in rows:
        theirs, mine = (statistics.median(figures[who, where][what]) for who in ("lmcache", "ours"))
        gbps = args.mib * 2**20 / 1e9
        print(f"{label:24} LMCache {theirs * 1e3:7.1f} ms ({gbps / theirs:5.2f} GB/s)   ours {mine * 1e3:7.1f} ms "
              f"({gbps / mine:5.2f} GB/s)   {theirs / mine:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
